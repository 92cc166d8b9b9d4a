"""HTTP only: schemas, routes, OpenAI-style errors, settings, the command line."""
