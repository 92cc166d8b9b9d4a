"""Speculative decoding through the server: --speculative prompt-lookup gives the text the
default server gives (greedy), and /v1/memory and /metrics report its acceptance."""

from __future__ import annotations

import httpx

MODEL = "mlx-headroom/tiny-chat"
PROMPT = "def area(w, h):\n    return w * h\n\n" * 6


def _complete(url: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_lookup_serves_the_same_text_and_reports_acceptance(server, start_server) -> None:
    plain = _complete(server.url)
    proc = start_server(args=["--speculative", "prompt-lookup", "--speculative-max-rows", "8"])
    spec = _complete(proc.url)
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    usage = spec["usage"]
    assert {k: usage[k] for k in plain["usage"]} == plain["usage"]
    assert "speculative" not in plain["usage"] and "completion_tokens_details" not in plain["usage"]
    engine = httpx.get(f"{proc.url}/v1/memory").json()["engine"]
    report = engine["speculative"]
    assert report["method"] == "prompt-lookup" and report["max_rows"] == 8
    assert report["drafted_tokens"] > 0
    # The request's own figures: this request is the only one that drafted.
    drafted, accepted = report["drafted_tokens"], report["accepted_tokens"]
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": accepted,
                                                  "rejected_prediction_tokens": drafted - accepted}
    mine = usage["speculative"]
    assert (mine["drafted_tokens"], mine["accepted_tokens"]) == (drafted, accepted)
    assert mine["acceptance_rate"] == round(accepted / drafted, 4)
    # Each decode step emits the target's own token and the drafts it accepted.
    steps = usage["completion_tokens"] / mine["tokens_per_step"]
    assert steps <= usage["completion_tokens"] and steps + accepted >= usage["completion_tokens"] - 0.01
    assert accepted == 0 or mine["tokens_per_step"] > 1
    metrics = httpx.get(f"{proc.url}/metrics").text
    assert f"mlx_headroom_speculative_drafted_tokens_total {float(report['drafted_tokens'])}" in metrics
    assert "mlx_headroom_speculative_acceptance_rate" in metrics


def test_a_draft_model_serves_the_same_text_and_reports_its_drafts(
        server, start_server, tiny_model_path) -> None:
    """--draft-model (here the model itself: every draft is accepted) serves the default
    server's text, and /v1/memory names the draft model with its counters."""
    plain = _complete(server.url)
    proc = start_server(args=["--draft-model", str(tiny_model_path)])
    spec = _complete(proc.url)
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    assert all(spec["usage"][k] == plain["usage"][k] for k in ("prompt_tokens", "completion_tokens"))
    report = httpx.get(f"{proc.url}/v1/memory").json()["engine"]["speculative"]
    assert report["method"] == "draft-model" and report["draft_model"] == str(tiny_model_path)
    assert report["drafted_tokens"] > 0 and report["accepted_tokens"] == report["drafted_tokens"]


def test_the_draft_model_method_needs_a_draft_model(tiny_model_path, capsys) -> None:
    from server.cli import main

    assert main(["serve", "--model", str(tiny_model_path), "--speculative", "draft-model"]) == 2
    assert "--speculative draft-model drafts from --draft-model" in capsys.readouterr().err


def test_a_draft_model_that_does_not_fit_beside_the_model_stops_the_start(tiny_model_path, capsys) -> None:
    """Under a ceiling that holds the model and its reserve but not a second copy of its
    weights, the pair is refused at load (exit 4) with the draft's bytes in the numbers."""
    from server.cli import main

    weights = 2_629_120  # the tiny model's float32 weights
    args = ["serve", "--model", str(tiny_model_path), "--memory-probe", "allocator",
            "--reserve-context-tokens", "256", "--memory-tier", "custom",
            "--memory-ceiling-bytes", str(2 * weights), "--port", "0"]
    assert main([*args, "--draft-model", str(tiny_model_path)]) == 4
    err = capsys.readouterr().err
    assert f"with the draft model {tiny_model_path} (its weights 2.5 MiB and KV for 256 reserved " in err
    assert "does not fit" in err
