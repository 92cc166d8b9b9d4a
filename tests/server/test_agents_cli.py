"""Opt-in: the real agents from npm finish a turn against this server (docs/agents.md).

Codex (`codex exec`, over the Responses API) and Claude Code (`claude -p`, over the
Messages API) run as a user runs them, configured only through their own files, flags and
environment variables, in a temporary home with no network besides this server. The
model is the tiny model with think markers, scripted to think and then answer
(tests/server/scripted.py); the test is about the protocol: each CLI must end its turn with
the answer, the thinking kept out of it, and no error.

The agents' own prompts are trimmed (Codex's instructions file and features, Claude Code's
`--bare`, `--system-prompt` and `--tools`): the tiny model's byte tokenizer makes their full
prompts 40k+ tokens, which a 2-core CPU prefills for minutes.

Run when both CLIs are installed under $MLX_HEADROOM_AGENTS_CLI (default /tmp/agents-cli;
the versions .ci/run installs):

    npm install --prefix /tmp/agents-cli @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.tiny_model import TinyModelShape
from tests.server.scripted import EOS, ScriptedModel, build_thinking_model, scripted_server, token_ids

PREFIX = Path(os.environ.get("MLX_HEADROOM_AGENTS_CLI", "/tmp/agents-cli"))
BIN = PREFIX / "node_modules" / ".bin"
INSTALL = f"npm install --prefix {PREFIX} @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197"
MODEL = "local-coder"
THOUGHT = "The user greets me."
ANSWER = "Hi from the tiny model."
TIMEOUT_S = 300

pytestmark = [
    pytest.mark.agents_cli,
    pytest.mark.skipif(not ((BIN / "codex").exists() and (BIN / "claude").exists()),
                       reason=f"the agent CLIs are not installed; install them with: {INSTALL}"),
]


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ScriptedModel]]:
    # 32k of context: the agents' trimmed first requests are about 8k byte tokens.
    path = build_thinking_model(tmp_path_factory.mktemp("agents") / "thinker-32k",
                                TinyModelShape(max_position_embeddings=32768))
    with scripted_server(path, MODEL, EOS, token_ids) as (url, model):
        model.say(f"{THOUGHT}\n</think>\n\n{ANSWER}")
        yield url, model


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", ""), "HOME": str(cwd), "LANG": "C.UTF-8", "NO_COLOR": "1"}
    return subprocess.run(cmd, cwd=cwd, env={**base, **env}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def test_codex_exec_finishes_a_turn(agent_server, tmp_path):
    url, _ = agent_server
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "instructions.md").write_text("You are a terse coding agent. Answer in one line.\n")
    (home / "config.toml").write_text(f"""\
model = "{MODEL}"
model_provider = "mlx-headroom"
model_context_window = 32768
model_auto_compact_token_limit = 24000
model_instructions_file = "{home / 'instructions.md'}"
web_search = "disabled"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.mlx-headroom]
name = "mlx-headroom"
base_url = "{url}/v1"
env_key = "MLX_HEADROOM_API_KEY"
wire_api = "responses"
""")
    work = tmp_path / "work"
    work.mkdir()
    features = [arg for name in ("multi_agent", "goals", "apps", "plugins", "image_generation")
                for arg in ("--disable", name)]
    done = _run([str(BIN / "codex"), "exec", "--skip-git-repo-check", "--ephemeral", "--sandbox",
                 "read-only", "--json", *features, "say hi"], work,
                {"CODEX_HOME": str(home), "MLX_HEADROOM_API_KEY": "sk-local"})
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    assert done.returncode == 0, (kinds, done.stdout[-3000:], done.stderr[-3000:])
    assert "turn.completed" in kinds and "turn.failed" not in kinds, events
    messages = [e["item"]["text"] for e in events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages == [ANSWER]
    usage = next(e["usage"] for e in events if e.get("type") == "turn.completed")
    assert usage["reasoning_output_tokens"] == len(THOUGHT)  # a token per byte


def test_claude_code_print_mode_finishes_a_turn(agent_server, tmp_path):
    url, _ = agent_server
    env = {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "sk-local",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, updates or error reports
        "DISABLE_AUTOUPDATER": "1",
    }
    done = _run([str(BIN / "claude"), "-p", "--bare", "--model", MODEL, "--output-format", "json",
                 "--system-prompt", "You are a terse coding agent. Answer in one line.",
                 "--tools", "Read", "--max-turns", "2", "say hi"], tmp_path, env)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert result["result"] == ANSWER
