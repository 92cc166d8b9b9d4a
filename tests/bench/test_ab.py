"""bench.ab runs a command per configuration, interleaved, in fresh processes with each
configuration's environment and arguments, and summarises the JSON fields it prints."""

from __future__ import annotations

import json
import sys

import pytest

from bench.ab import main, parse_config

# prints the configuration it saw, and fails when told to
SCRIPT = (
    "import json, os, sys\n"
    "if os.environ.get('FAIL'): sys.exit(3)\n"
    "print('noise')\n"
    "print(json.dumps({'ms': float(os.environ.get('MS', '1')) + len(sys.argv) - 1, 'name': 'x'}))\n"
)


def test_each_configuration_gets_its_environment_and_arguments(capsys, tmp_path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    main(["--runs", "2", "--field", "ms", "--field", "missing", "--config", "base=",
          "--config", "slow=MS=5", "--arg", "slow=extra", "--config", "broken=FAIL=1",
          "--", sys.executable, str(script)])
    report = json.loads(capsys.readouterr().out)
    base, slow, broken = (report["configs"][n] for n in ("base", "slow", "broken"))
    assert base["fields"]["ms"] == {"median": 1.0, "min": 1.0, "max": 1.0, "values": [1.0, 1.0]}
    assert slow["fields"]["ms"]["values"] == [6.0, 6.0]  # MS=5, plus one extra argument
    assert slow["env"] == {"MS": "5"} and slow["args"] == ["extra"]
    assert base["fields"]["missing"] is None
    assert broken["fields"]["ms"] is None and len(broken["failures"]) == 2
    assert broken["failures"][0].startswith("rc=3")


def test_the_closing_json_object_is_found_on_one_line_or_indented() -> None:
    from bench.ab import last_json

    assert last_json('log {"a": 1}\n{"ms": 2}\n') == {"ms": 2}
    assert last_json('{"first": 1}\nlog\n' + json.dumps({"ms": 3, "d": {"x": 1}}, indent=1)) == \
        {"ms": 3, "d": {"x": 1}}
    assert last_json("no json here") is None


def test_a_malformed_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="not VAR=VALUE"):
        parse_config("x=NOEQUALS")
    with pytest.raises(ValueError, match="NAME"):
        parse_config("=A=1")
