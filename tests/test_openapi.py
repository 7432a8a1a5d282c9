"""`runtime serve`'s /openapi.json tells the truth: schemathesis (an OpenAPI fuzzer) runs every one of its checks
against a live server on the tiny bundle of several shapes, and the document describes the create request for JSON
and multipart forms, from the same field table the server checks requests with.

The server runs with `--max-steps 2`, so the jobs the fuzzer queues take a moment each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import ROOT
from .test_serve import KEY, Server, serving

CREATE_FIELDS = {"prompt", "negative_prompt", "model", "size", "seconds", "seed", "num_inference_steps",
                 "guidance_scale", "flow_shift", "fps", "sampler", "sigmas"}  # the t2v bundle's: no media, one expert


@pytest.fixture(scope="module")
def server(shapes_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(shapes_bundle, tmp_path_factory.mktemp("openapi") / "jobs", "--api-key", KEY,
                 "--max-steps", "2") as server:
        yield server


# The operations whose documents differ from kind to kind: what other kinds' servers are fuzzed on (a remix's is an
# edit's JSON body without the video; an image edit is in image-editing bundles' documents only).
KIND_OPERATIONS = "^(createVideo|editVideo|extendVideo|editImage)$"


def schemathesis_clean(server: Server, cwd: Path, key: str | None = KEY, examples: int = 15, seed: int = 1,
                       size: str = "64x32", frames: int = 9, operations: str | None = None,
                       phases: tuple[str, ...] = ("coverage", "fuzzing", "stateful")) -> None:
    """Run schemathesis with every check against the server's document, drawing real images and videos (of `frames`
    frames of `size`) for its files (tests/schemathesis_hooks.py); assert it finds nothing, in each phase."""
    cli = "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())"
    args = [sys.executable, "-c", cli, "run", server.url + "/openapi.json", "--checks", "all", "--max-examples",
            str(examples), "--seed", str(seed), "--generation-database", "none", "--workers", "1",
            "--request-timeout", "30", "--no-color", "--phases", ",".join(phases)]
    args += ["-H", f"Authorization: Bearer {key}"] if key else []
    args += ["--include-operation-id-regex", operations] if operations else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
           "WAN_AOT_FUZZ_SIZE": size, "WAN_AOT_FUZZ_FRAMES": str(frames)}
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    clean = "No issues found" in summary or ("failure" not in summary and "error" not in summary)  # warnings aside
    assert proc.returncode == 0 and clean, proc.stdout[-6000:] + server.output()
    for phase in phases:
        assert f"✅  {phase.capitalize()}" in proc.stdout, proc.stdout[-3000:]


def test_schemathesis_finds_nothing_with_every_check(server: Server, tmp_path: Path) -> None:
    """Every check schemathesis has (`--checks all`: status codes, content types, headers and bodies as documented,
    schema-valid data accepted and invalid data refused, 405 with Allow, auth enforced, created videos retrievable
    and deleted ones gone), over its coverage, fuzzing and stateful phases, with a fixed seed: every route, the
    remix, edit, cancel and webhook endpoints' too."""
    schemathesis_clean(server, tmp_path)


def test_the_create_request_is_documented_for_json_and_multipart(server: Server) -> None:
    import httpx

    from runtime.serve.schema import NOT_BOTH_STEP_COUNTS

    doc = httpx.get(server.url + "/openapi.json").json()
    create = doc["paths"]["/v1/videos"]["post"]
    body = create["requestBody"]["content"]
    assert body.keys() == {"application/json", "multipart/form-data"} and create["requestBody"]["required"]
    for schema in (body["application/json"]["schema"], body["multipart/form-data"]["schema"]):
        fields = schema["properties"]
        assert fields.keys() == CREATE_FIELDS and schema["required"] == ["prompt"]
        assert schema["additionalProperties"] is False
        assert fields["size"]["enum"] == ["64x32", "32x64"] and fields["seconds"]["enum"] == ["0.5625", "0.3125"]
        assert (fields["num_inference_steps"]["minimum"], fields["num_inference_steps"]["maximum"]) == (1, 2)
        assert fields["seed"]["type"] == "integer" and fields["guidance_scale"]["minimum"] == 0
        assert fields["prompt"]["maxLength"] == 20_000 and fields["fps"]["maximum"] == 240
        assert fields["sampler"]["enum"] == ["unipc", "euler", "dpm++"] and fields["sampler"]["default"] == "unipc"
        assert schema["allOf"][0] == NOT_BOTH_STEP_COUNTS  # sigmas set the step count: one or the other
    assert body["application/json"]["schema"]["properties"]["sigmas"]["items"]["maximum"] == 1
    assert body["multipart/form-data"]["schema"]["properties"]["sigmas"]["type"] == "string"  # comma-separated
    error = {"$ref": "#/components/schemas/Error"}
    for code in ("400", "401", "413", "415", "429", "503"):
        assert create["responses"][code]["content"]["application/json"]["schema"] == error, code
    assert create["responses"]["429"]["headers"]["Retry-After"]["required"]
    assert create["responses"]["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Video"}
    assert set(doc["components"]["schemas"]["Error"]["properties"]) == {"error"}
    assert doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"].keys() == {"text/plain"}
    content = doc["paths"]["/v1/videos/{video_id}/content"]["get"]["responses"]
    # the video, a thumbnail (WebP), a spritesheet (JPEG)
    assert content["200"]["content"].keys() == {"video/mp4", "image/webp", "image/jpeg"}
    assert {"404", "409"} <= content.keys()
    assert doc["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
    codes = {code for path in doc["paths"].values() for op in path.values() for code in op["responses"]}
    assert "422" not in codes and "HTTPValidationError" not in doc["components"]["schemas"]  # bad input is a 400


def test_images_are_files_in_a_form_and_data_urls_in_json() -> None:
    """A first-last-frame bundle's document (built from its offer, no server): both images required, binary parts in
    a form and strings in JSON; a second size with other durations gets `seconds` per size."""
    import jsonschema

    from runtime import kinds
    from runtime.manifest import Defaults
    from runtime.serve.schema import Offer, body_schema

    offer = Offer(models=("flf",), shapes=(("64x32", 9), ("64x32", 5), ("32x64", 17)), kind=kinds.get("flf2v"),
                  defaults=Defaults(steps=30, guidance=5.0, flow_shift=3.0))
    form, plain = body_schema(offer, form=True), body_schema(offer, form=False)
    for schema in (form, plain):
        assert schema["required"] == ["prompt", "input_reference", "last_image"]
        assert "guidance_scale_2" not in schema["properties"]  # one expert
    assert form["properties"]["input_reference"]["format"] == "binary"
    last = plain["properties"]["last_image"]  # a data URL, or {"image_url": a data URL}
    assert [b.get("type") for b in last["anyOf"]] == ["string", "object"] and "data URL" in last["description"]
    image = "data:image/png;base64,AAAA"
    ok = {"prompt": "a bird", "input_reference": image, "last_image": {"image_url": image}}
    jsonschema.validate({**ok, "seconds": "0.5625"}, plain)  # the default size's
    jsonschema.validate({**ok, "size": "32x64", "seconds": "1.0625"}, plain)
    for bad in ({**ok, "size": "32x64", "seconds": "0.5625"}, {**ok, "seconds": "1.0625"}, {"prompt": "a bird"},
                {**ok, "prompt": " "}, {**ok, "fps": 0}, {**ok, "guidance_scale_2": 1.0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, plain)


def test_the_flow_shift_range_is_usable_at_every_step_count() -> None:
    """The documented flow_shift range is one where no step count up to the limit makes an unusable schedule, so a
    request in range never fails on its schedule (its ends, at step counts from 1 to the most a job may run)."""
    from runtime import samplers, scheduler
    from runtime.serve.schema import FLOW_SHIFT, MAX_STEPS, SIGMA_MIN

    config = scheduler.UniPCConfig()
    for sampler in samplers.SAMPLERS:
        for shift in FLOW_SHIFT:
            for steps in (1, 2, 3, 7, 50, 500, MAX_STEPS - 1, MAX_STEPS):
                samplers.check_plan(sampler, steps, shift, config, None, 3.0)
            # custom sigmas at the documented ends: the highest and lowest levels a request may give
            samplers.check_plan(sampler, 3, shift, config, (1.0, 0.5, SIGMA_MIN), 3.0)
    with pytest.raises(Exception, match="unusable"):  # and the check itself can fail: beyond the range
        samplers.check_plan("unipc", MAX_STEPS, 1000.0, config, None, 3.0)
