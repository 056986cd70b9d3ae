"""The shipped unit verifies, and asks for what the daemon relies on."""

import os
import shutil
import subprocess
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: ./setup.sh --test installs it"
    unit = open(os.path.join(ROOT, "systemd", "colibrid.service")).read()
    colibrid = os.path.join(sysconfig.get_path("scripts"), "colibrid")
    assert os.path.exists(colibrid)
    (tmp_path / "colibrid.service").write_text(unit.replace("/opt/colibri/.venv/bin/colibrid", colibrid))
    r = subprocess.run([analyze, "verify", str(tmp_path / "colibrid.service")], capture_output=True, text=True)
    assert r.returncode == 0 and "colibrid.service" not in r.stderr, r.stderr
    for line in ("Type=notify", "WatchdogSec=", "RuntimeDirectory=colibri", "StateDirectory=colibri",
                 "User=colibri", "LimitMEMLOCK=", "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes",
                 "PrivateTmp=yes", "ExecReload=/bin/kill -HUP $MAINPID", "RestrictAddressFamilies=AF_UNIX",
                 "ExecStartPre=+/opt/colibri/.venv/bin/colibrid --config /etc/colibri/colibri.yaml drives",
                 "ExecStart=/opt/colibri/.venv/bin/colibrid --config /etc/colibri/colibri.yaml"):
        assert line in unit, line
    assert "colibri" in open(os.path.join(ROOT, "systemd", "colibri.sysusers.conf")).read()


def test_the_gateway_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: ./setup.sh --test installs it"
    unit = open(os.path.join(ROOT, "systemd", "colibri-gateway.service")).read()
    gateway = os.path.join(sysconfig.get_path("scripts"), "colibri-gateway")
    assert os.path.exists(gateway), "pip install -e . installs the colibri-gateway entry point"
    (tmp_path / "colibri-gateway.service").write_text(unit.replace("/opt/colibri/.venv/bin/colibri-gateway", gateway))
    r = subprocess.run([analyze, "verify", str(tmp_path / "colibri-gateway.service")], capture_output=True, text=True)
    assert r.returncode == 0 and "colibri-gateway.service" not in r.stderr, r.stderr
    for line in ("--host 127.0.0.1", "User=colibri", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "After=colibrid.service"):
        assert line in unit, line
