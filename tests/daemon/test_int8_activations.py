"""activations: int8 from the user's side: recorded by convert, chosen by colictl run and by
the daemon's config, and said on every output when on (run's and generate's stderr, status,
JSON precision, the gateway's system_fingerprint), never when off; asked of experts it
cannot compute on, one line and the model's exit code."""

import json
import subprocess
import sys

import httpx
import pytest
from daemons import colibrid, gateway
from test_daemon import ctl

from colibri.ctl import exitcodes
from colibri.daemon.protocol import precision_tag, precision_text
from colibri.storage.container import open_container
from colibri.storage.demo import write_demo_model


def colictl(*args):
    return subprocess.run([sys.executable, "-m", "colibri.ctl", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("a8")
    demo = write_demo_model(tmp / "demo")
    for name, extra in (("q4", ("--activations", "float32")), ("q4a8", ())):  # int4's default: int8 activations
        r = colictl("convert", "--dtype", "int4", *extra, demo, tmp / name)
        assert r.returncode == 0, r.stderr
    return tmp


def run_json(model, *args):
    r = colictl("run", "--model", model, "--json", "--max-tokens", 4, *args, "Once upon a time")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_convert_records_it_and_run_follows_or_overrides(models):
    assert open_container(str(models / "q4a8")).manifest["activations"] == "int8"
    assert open_container(str(models / "q4")).manifest["activations"] == "float32"
    on, err = run_json(models / "q4a8")
    assert on["stats"]["model"]["precision"]["activations"] == "int8"
    assert "activations int8" in err and "int8 activations" in err and "LOSSY" in err
    off, err = run_json(models / "q4a8", "--activations", "float32")
    assert off["stats"]["model"]["precision"]["activations"] == "float32"
    assert "int8" not in err and "LOSSY" in err  # int4 experts are lossy; the activations are not said
    asked, err = run_json(models / "q4", "--activations", "int8")
    assert asked["token_ids"] == on["token_ids"] and "int8 activations" in err
    exact, _ = run_json(models / "q4")
    assert exact["token_ids"] == off["token_ids"]


def test_int8_activations_of_float_experts_is_one_line(models):
    r = colictl("run", "--model", models / "demo", "--activations", "int8", "x")
    assert r.returncode == exitcodes.MODEL and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "int8 or int4 experts" in r.stderr and "Traceback" not in r.stderr
    r = colictl("convert", "--activations", "int8", models / "demo", models / "bad")
    assert r.returncode == exitcodes.USAGE and "--dtype int4" in r.stderr and not (models / "bad").exists()


def test_the_daemon_takes_it_from_its_config_and_says_so(models, tmp_path):
    with colibrid(tmp_path, models / "q4", "activations: int8\n") as sock:
        st = ctl(sock, "status")
        assert "activations int8" in st.stdout, st.stdout
        g = ctl(sock, "generate", "--json", "--max-tokens", 4, "Once upon a time")
        assert g.returncode == 0 and "int8 activations" in g.stderr
        assert json.loads(ctl(sock, "status", "--json").stdout)["model"]["precision"]["activations"] == "int8"
        with gateway(sock) as url:
            r = httpx.post(url + "/v1/completions", json={"prompt": "Once upon", "max_tokens": 3}, timeout=60).json()
            assert r["system_fingerprint"] == "colibri-int4g64-a8-lossy", r
            lines = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2, "stream": True},
                               timeout=60).text.split("\n\n")
            chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert chunks and all(c["system_fingerprint"] == "colibri-int4g64-a8-lossy" for c in chunks)
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--print-config"], capture_output=True, text=True,
                       timeout=60)
    assert "activations: auto" in r.stdout


def test_the_words_and_the_tag():
    exact = {"dense": "bf16", "experts": "bf16", "group_size": None, "lossy": False, "activations": "float32",
             "source": {"dense": "bf16", "experts": "bf16"}}
    assert precision_text(exact) == "dense bf16, experts bf16" and precision_tag(exact) == "colibri-bf16"
    q4 = exact | {"experts": "int4", "group_size": 64, "lossy": True}
    assert precision_text(q4) == "dense bf16, experts int4 g64 (LOSSY: converted from bf16 experts / bf16 dense)"
    a8 = q4 | {"activations": "int8"}
    assert precision_text(a8).endswith("activations int8 (LOSSY: converted from bf16 experts / bf16 dense; int8 "
                                       "activations)")
    assert precision_tag(a8) == "colibri-int4g64-a8-lossy"
