"""LoRA sets per run and per request (issue 50): one pipeline or one server, many adapters, switched between jobs.

On the tiny bundle in bf16 (and in int8: tests/test_quantize.py; two experts: tests/test_lora.py), a run of jobs
none -> A -> B -> A+B at (0.5, 1.0) -> none -> A makes, job by job, exactly the frames `runtime generate --lora ...`
makes in a fresh process with the same set, and the weights end bit for bit as a fresh load's; through the server the
same jobs, sent as JSON, as a form field of JSON and through the openai SDK's `extra_body`, make the CLI's mp4s, the
switches are counted, and a queue of A, B, A, B, A, B switches at most twice. Every bad `lora` is a 400 naming the
field before anything is queued; an adapter that does not fit stops `serve` in one line.

Adapters are written in the adapter layout (runtime/lora.py) from random numbers; B is converted from a Wan-format
LoRA by export/lora.py's `convert`, what `python -m export lora` runs, as a user would convert theirs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import runtime

from .conftest import run_cli, run_modules

PROMPT = "a lighthouse in a storm"
SEED, STEPS = 5, 2
# The jobs of the issue, in order: each set's (name, scale) entries.
SEQUENCE = ([], [("A", 1.0)], [("B", 1.0)], [("A", 0.5), ("B", 1.0)], [], [("A", 1.0)])
LAYERS = ("attn1.to_q", "attn1.to_out.0", "attn2.to_k", "ffn.net.0.proj", "ffn.net.2")


def make_adapter(bundle: Path, out: Path, seed: int, rank: int = 4, group: str = "transformer",
                 bundle_id: str | None = None) -> Path:
    """A random adapter for `bundle` in the layout `python -m export lora` writes: A (r, in) and B (out, r) for some
    linear layers of every block of expert `group`, and a bias delta where the layer has a bias (`bundle_id`: the
    bundle its header names, if not `bundle`'s)."""
    from safetensors.numpy import save_file

    from runtime import manifest as mf
    from runtime.lora import FORMAT

    m = mf.read(bundle)
    wf = m.weights[group]
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, spec in wf.tensors.items():
        if len(spec.shape) == 2 and any(name.endswith(f".{layer}.weight") for layer in LAYERS):
            rows, cols = spec.shape
            tensors[f"{group}.{name}.lora_A"] = (rng.standard_normal((rank, cols)) * 0.3).astype(np.float32)
            tensors[f"{group}.{name}.lora_B"] = (rng.standard_normal((rows, rank)) * 0.3).astype(np.float32)
            bias = name.removesuffix(".weight") + ".bias"
            if bias in wf.tensors:
                tensors[f"{group}.{bias}.delta"] = (rng.standard_normal(rows) * 0.1).astype(np.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": FORMAT, "bundle_id": bundle_id or m.bundle_id,
                                           "targets": str(len(tensors))})
    return out


def set_name(entries: list[tuple]) -> str:
    return "+".join(f"{e[0]}{e[1]:g}" for e in entries) or "none"


def cli_references(bundle: Path, lora_dir: Path, sets: list[list[tuple]], out: Path, *extra: str
                   ) -> dict[str, tuple[np.ndarray, Path]]:
    """`runtime generate --lora DIR/NAME.safetensors:SCALE ...` in a fresh process for each distinct set (two at a
    time): set name -> (its float frames, its mp4)."""
    from safetensors.numpy import load_file

    out.mkdir(parents=True, exist_ok=True)
    distinct = {set_name(s): s for s in sets}
    commands = []
    for name, entries in distinct.items():
        flags = [f for e in entries for f in ("--lora", f"{lora_dir / (e[0] + '.safetensors')}:{e[1]}")]
        commands.append(["runtime", "generate", str(bundle), "--prompt", PROMPT, "--seed", str(SEED), "--steps",
                         str(STEPS), *extra, *flags, "--out", str(out / f"{name}.mp4"), "--frames-out",
                         str(out / f"{name}.safetensors"), "-q"])
    run_modules(*commands)
    return {name: (load_file(str(out / f"{name}.safetensors"))["frames"], out / f"{name}.mp4") for name in distinct}


def check_sequence(bundle: Path, lora_dir: Path, references: dict[str, tuple[np.ndarray, Path]], **run) -> None:
    """SEQUENCE in one pipeline: every job's frames are the CLI's with its set exactly; a set equal to the one held
    switches nothing; the weights end equal to a fresh load of the last set, bit for bit."""
    pipe = runtime.load(bundle, lora_dir=lora_dir)
    assert set(pipe.loras) == {"A", "B"}
    for entries in SEQUENCE:
        frames = pipe.generate(PROMPT, seed=SEED, steps=STEPS, progress=False, loras=list(entries), **run)
        cli = references[set_name(entries)][0]
        assert np.array_equal(frames, cli), (set_name(entries), float(np.abs(frames - cli).max()))
    assert pipe.use_loras([("A", 1.0)]) is None  # the set it holds: nothing to do
    assert pipe.use_loras([(str(lora_dir / "A.safetensors"), 1.0)]) is None  # the same file by path
    fresh = runtime.load(bundle, loras=[(lora_dir / "A.safetensors", 1.0)])
    plain = runtime.load(bundle)
    for group in pipe.manifest.weights:
        if group not in ("transformer", "transformer_2"):
            continue
        program = "denoise_step" if group == "transformer" else "denoise_step_2"
        mine, theirs, base = (p.bundle.weights(group, program) for p in (pipe, fresh, plain))
        assert mine.keys() == theirs.keys()
        for name in mine:
            a, b = np.asarray(mine[name]), np.asarray(theirs[name])
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name  # bit for bit
        changed = [n for n in mine if np.asarray(mine[n]).tobytes() != np.asarray(base[n]).tobytes()]
        assert changed  # ...and A did change them


@pytest.fixture(scope="module")
def bf16_loras(bf16_bundle: Path, checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapters A and B of the bf16 tiny bundle; B converted by `python -m export lora` from a Wan-format LoRA
    (the original Wan / ComfyUI keys)."""
    from export.lora import convert

    from .test_lora import wan_format_lora

    root = tmp_path_factory.mktemp("loras")
    make_adapter(bf16_bundle, root / "dir" / "A.safetensors", seed=1)
    source = wan_format_lora(checkpoints["tiny"], root / "source", seed=2)
    convert(source, bf16_bundle, root / "dir" / "B.safetensors")
    return root / "dir"


@pytest.fixture(scope="module")
def bf16_references(bf16_bundle: Path, bf16_loras: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return cli_references(bf16_bundle, bf16_loras, list(SEQUENCE), tmp_path_factory.mktemp("cli"))


def test_switching_sets_in_process_equals_fresh_processes(bf16_bundle: Path, bf16_loras: Path,
                                                          bf16_references: dict) -> None:
    check_sequence(bf16_bundle, bf16_loras, bf16_references)
    # the sets do differ (else the test would prove nothing)
    frames = [bf16_references[n][0] for n in ("none", "A1", "B1", "A0.5+B1")]
    assert all(not np.array_equal(a, b) for i, a in enumerate(frames) for b in frames[i + 1:])


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_the_server_switches_per_request(bf16_bundle: Path, bf16_loras: Path, bf16_references: dict,
                                         tmp_path: Path) -> None:
    """The jobs of SEQUENCE through one server, one at a time, each sent another way (JSON, a form field of JSON, the
    openai SDK's extra_body): every mp4 is the CLI's, byte for byte in its frames; 5 switches counted and timed; then a
    queue of A, B, A, B, A, B, waiting behind a long job, runs with at most 2 switches and every job finishes."""
    import httpx

    from .test_serve import _mp4_frames, _wait, serving

    with serving(bf16_bundle, tmp_path / "jobs", "--lora-dir", str(bf16_loras), "--lora-affinity-max", "4") as server:
        client = server.client(key="unused")
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert card["max_loras"] == 4
        assert {a["name"]: (a["experts"], a["tensors"]) for a in card["loras"]} == {
            "A": (["transformer"], 20), "B": (["transformer"], 16)}  # B: 2 blocks x self-attention q, k, v, o + biases
        assert {a["name"]: a["rank"] for a in card["loras"]} == {"A": 4, "B": 2}
        body = httpx.get(server.url + "/openapi.json").json()["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
        listed = body["application/json"]["schema"]["properties"]["lora"]
        assert listed["maxItems"] == 4 and listed["items"]["properties"]["name"]["enum"] == ["A", "B"]
        assert "expert" not in listed["items"]["properties"]  # one expert
        form = body["multipart/form-data"]["schema"]["properties"]["lora"]
        assert form["type"] == "string" and form["contentSchema"] == {k: v for k, v in listed.items()
                                                                       if k != "description"}

        def send(i: int, entries: list[tuple]) -> str:
            lora = [{"name": n, "scale": s} for n, s in entries]
            fields = {"prompt": PROMPT, "seed": SEED, "num_inference_steps": STEPS}
            if i % 3 == 0:  # JSON
                r = httpx.post(server.url + "/v1/videos", json={**fields, "lora": lora})
            elif i % 3 == 1:  # a multipart form, `lora` a field holding the JSON
                parts = {k: (None, str(v)) for k, v in {**fields, "lora": json.dumps(lora)}.items()}
                r = httpx.post(server.url + "/v1/videos", files=parts)
            else:  # the SDK: lora[][name] x n, then lora[][scale] x n
                return client.videos.create(prompt=PROMPT, extra_body={"seed": SEED, "num_inference_steps": STEPS,
                                                                       "lora": lora}).id
            assert r.status_code == 200, r.text
            return r.json()["id"]

        for i, entries in enumerate(SEQUENCE):
            video = _wait(client, send(i, list(entries)), ("completed", "failed"))
            assert video.status == "completed", (video.error, server.output())
            served = _mp4_frames(client.videos.download_content(video.id).read(), tmp_path)
            cli = _mp4_frames(bf16_references[set_name(entries)][1].read_bytes(), tmp_path)
            assert np.array_equal(served, cli), set_name(entries)
        metrics = httpx.get(server.url + "/metrics").text
        assert _metric(metrics, "wan_aot_lora_switches_total") == 5  # none->A->B->A+B->none->A
        assert _metric(metrics, "wan_aot_lora_switch_seconds_count") == 5
        assert "LoRA set A@0.5 + B@1, switched to in" in server.output()

        # affinity: A, B, A, B, A, B queued behind a long job of no adapter
        long = httpx.post(server.url + "/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 60}).json()["id"]
        burst = [httpx.post(server.url + "/v1/videos", json={"prompt": PROMPT, "num_inference_steps": 1,
                                                             "lora": [{"name": name}]}).json()["id"]
                 for name in "ABABAB"]
        assert client.videos.retrieve(burst[-1]).status == "queued"
        for video_id in [long, *burst]:
            assert _wait(client, video_id, ("completed", "failed"), timeout=180).status == "completed"
        # the long job switched from A to none; then the burst at most twice (none -> A, A -> B), not six times
        switched = _metric(httpx.get(server.url + "/metrics").text, "wan_aot_lora_switches_total") - 5 - 1
        assert 1 <= switched <= 2, (switched, server.output())


def test_bad_lora_input_is_a_400_before_anything_is_queued(tmp_path: Path) -> None:
    """Each bad `lora`, in JSON, in a form field of JSON and in the SDK's grouped fields: a 400 in the OpenAI shape
    whose param is `lora` and whose message names the entry and what is wrong; nothing queued. A tenant limited to
    some adapters (`loras=` in --api-keys FILE) may use only those, and /v1/models lists only those."""
    from runtime.lora import Adapter
    from runtime.serve.tenants import Keys

    from .test_tenants import _bearer, app_client

    adapters = tuple(Adapter(n, tmp_path / f"{n}.safetensors", 4, ("transformer",), ("transformer", "transformer_2"),
                             20) for n in ("A", "B"))
    keys = tmp_path / "keys"
    keys.write_text("sk-full-000000000000 full\nsk-some-111111111111 some loras=B\n")
    cases = [
        ([{"name": "C"}], "lora[0].name 'C' is not an adapter this server offers: it offers A, B"),
        ([{"name": "A", "scale": float("inf")}], "lora[0].scale must be a finite number in -4..4"),
        ([{"name": "A", "scale": 4.5}], "lora[0].scale must be a finite number in -4..4, got 4.5"),
        ([{"name": "A", "scale": -4.01}], "lora[0].scale must be a finite number in -4..4"),
        ([{"name": "A"}, {"name": "B", "scale": "1"}], "lora[1].scale must be a finite number in -4..4, got '1'"),
        ([{"name": "A"}] * 3, "lora has 3 entries; this server applies at most 2 (--max-loras)"),
        ([{"name": "A", "expert": "low"}], "lora[0].expert is for two-expert bundles; this one is Wan 2.1 "
                                           "text-to-video with one expert"),
        ([{"name": "A", "strength": 1}], "lora[0]: 'strength' is not a key of a lora entry"),
        ("A", "lora must be a list of {\"name\", \"scale\"} objects"),
    ]
    client, state = app_client(tmp_path, keys=Keys.load(keys, None, frozenset({"A", "B"})), max_loras=2)
    state.offer = dataclasses.replace(state.offer, loras=adapters, max_loras=2)
    full, some = _bearer("sk-full-000000000000"), _bearer("sk-some-111111111111")
    for lora, message in cases:
        text = json.dumps(lora).replace("Infinity", "1e999")  # JSON has no inf: a number that overflows to it
        answers = [client.post("/v1/videos", content=f'{{"prompt": "a", "lora": {text}}}',
                               headers={**full, "Content-Type": "application/json"})]
        if not isinstance(lora, str):  # in a form, the same JSON as text
            answers.append(client.post("/v1/videos", files={"prompt": (None, "a"), "lora": (None, text)}, headers=full))
        for r in answers:
            assert r.status_code == 400, (lora, r.text)
            error = r.json()["error"]
            assert error["param"] == "lora" and error["message"].startswith(message), (lora, error)
            assert error["type"] == "invalid_request_error"
    # the SDK's grouped parts: paired in order; an expert, a missing scale, a file are refused
    grouped = [[("lora[][name]", "A"), ("lora[][name]", "C"), ("lora[][scale]", "1"), ("lora[][scale]", "0.5")],
               [("lora[][name]", "A"), ("lora[][scale]", "9")],
               [("lora[][name]", "A"), ("lora[][name]", "B"), ("lora[][scale]", "1")],
               [("lora[][name]", "A"), ("lora[][scale]", "1"), ("lora[][expert]", "low")],
               [("lora[][name]", "A"), ("lora", '[{"name": "B"}]')], [("lora[]", "A")]]
    messages = ["lora[1].name 'C' is not an adapter", "lora[0].scale must be a finite number in -4..4, got '9'",
                "lora: 2 lora[][name] fields but 1 lora[][scale]", "lora[][expert]: a form's grouped lora fields "
                "cannot say which entry an expert belongs to", "lora is sent twice",
                "lora must be a list of {\"name\", \"scale\"} objects, not of plain values"]
    for parts, message in zip(grouped, messages, strict=True):
        r = client.post("/v1/videos", files=[("prompt", (None, "a")), *[(k, (None, v)) for k, v in parts]],
                        headers=full)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora", r.text
        assert r.json()["error"]["message"].startswith(message), r.json()["error"]
    # a tenant limited to B
    r = client.post("/v1/videos", json={"prompt": "a", "lora": [{"name": "B"}, {"name": "A", "scale": 0.5}]},
                    headers=some)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
    assert r.json()["error"]["message"] == "lora[1].name 'A': your key may not use this adapter (it may use: B)"
    assert state.store.counts()["queued"] == 0  # nothing got in
    ok = [client.post("/v1/videos", json={"prompt": "a", "lora": [{"name": "B", "scale": -4}]}, headers=some),
          client.post("/v1/videos", files=[("prompt", (None, "a")), ("lora[][name]", (None, "A")),
                                           ("lora[][name]", (None, "B")), ("lora[][scale]", (None, "0.5")),
                                           ("lora[][scale]", (None, "1e0"))], headers=full),
          client.post("/v1/videos", files={"prompt": (None, "a"), "lora": (None, "")}, headers=full)]  # empty: none
    assert [r.status_code for r in ok] == [200, 200, 200], [r.text for r in ok]
    jobs = [state.store.get(r.json()["id"]).params["lora"] for r in ok]
    assert jobs == [[{"name": "B", "scale": -4.0, "expert": None}],
                    [{"name": "A", "scale": 0.5, "expert": None}, {"name": "B", "scale": 1.0, "expert": None}], []]


def test_two_expert_entries_are_checked_against_the_adapter(tmp_path: Path) -> None:
    """On a two-expert bundle an entry may say its expert (high | low), where the adapter fits it; JSON only."""
    from runtime.lora import Adapter

    from .test_tenants import app_client

    client, state = app_client(tmp_path, kind="t2v-moe")
    adapters = (Adapter("both", tmp_path / "both.safetensors", 8, ("transformer", "transformer_2"),
                        ("transformer", "transformer_2"), 40),
                Adapter("odd", tmp_path / "odd.safetensors", 8, ("transformer",), ("transformer",), 20))
    state.offer = dataclasses.replace(state.offer, loras=adapters)
    for lora, message in (([{"name": "both", "expert": "middle"}], "lora[0].expert must be one of high, low"),
                          ([{"name": "odd", "expert": "low"}], "lora[0]: adapter 'odd' does not fit the low expert")):
        r = client.post("/v1/videos", json={"prompt": "a", "lora": lora})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text
    r = client.post("/v1/videos", json={"prompt": "a", "lora": [{"name": "both", "scale": 0.5, "expert": "low"},
                                                                 {"name": "odd", "expert": "high"}]})
    assert r.status_code == 200, r.text
    assert state.store.get(r.json()["id"]).params["lora"] == [{"name": "both", "scale": 0.5, "expert": "low"},
                                                              {"name": "odd", "scale": 1.0, "expert": "high"}]


def test_an_adapter_that_does_not_fit_stops_serve_in_one_line(bf16_bundle: Path, tmp_path: Path) -> None:
    """`serve --lora-dir`: every adapter checked against the bundle at start; one made for another bundle or of other
    shapes, a missing or empty directory, a keys file naming an adapter not offered: one line naming the file, exit 2,
    before any port is bound."""
    from safetensors.numpy import load_file, save_file

    good = make_adapter(bf16_bundle, tmp_path / "one" / "good.safetensors", seed=1)
    make_adapter(bf16_bundle, tmp_path / "other" / "a.safetensors", seed=1, bundle_id="0123456789abcdef")
    tensors = load_file(str(good))
    key = next(k for k in tensors if k.endswith(".lora_A"))
    tensors[key] = tensors[key][:, :-1]  # one column short: a LoRA of another width
    (tmp_path / "shape").mkdir()
    save_file(tensors, str(tmp_path / "shape" / "wide.safetensors"), metadata=_header(good))
    (tmp_path / "empty").mkdir()
    (tmp_path / "keys").write_text("sk-a-0123456789 a loras=good,nope\nsk-b-0123456789 b\n")
    cases = [(("--lora-dir", str(tmp_path / "other")), f"--lora-dir {tmp_path / 'other'}: a.safetensors does not fit "
                                                       "this bundle: LoRA adapter", "was made for bundle 0123456789"),
             (("--lora-dir", str(tmp_path / "shape")), f"--lora-dir {tmp_path / 'shape'}: wide.safetensors does not "
                                                       "fit this bundle", "was the adapter made for another model?"),
             (("--lora-dir", str(tmp_path / "empty")), f"--lora-dir {tmp_path / 'empty'} holds no .safetensors", ""),
             (("--lora-dir", str(tmp_path / "none")), f"--lora-dir {tmp_path / 'none'} is not a directory", ""),
             (("--lora-dir", str(tmp_path / "one"), "--api-keys", str(tmp_path / "keys")),
              f"--api-keys {tmp_path / 'keys'} line 1: LoRA adapter 'nope' is not one the server offers (good)", ""),
             (("--lora-dir", str(tmp_path / "one"), "--max-loras", "0"), "--max-loras 0 must be >= 1", "")]
    for flags, message, also in cases:
        proc = run_cli("runtime", "serve", str(bf16_bundle), *flags, check=False)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}"), proc.stderr
        assert also in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def _header(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return f.metadata()
