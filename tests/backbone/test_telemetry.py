"""No usage data leaves a multihead process (`backbone.telemetry`): OpenVINO's converter and
NNCF, imported the way the trunk imports them, fall back to their no-telemetry stubs. Checked
in a fresh interpreter outside CI (their own CI check would hide a regression), so that no
module imported by another test decides the outcome."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("openvino")
pytest.importorskip("nncf")

PROBE = """
import json
from backbone.runners import openvino as runner
from backbone import quantize
runner._ov()
quantize._ov()
import openvino.tools.ovc.convert_impl as convert
import nncf.telemetry.wrapper as wrapper
print(json.dumps({"ovc": convert.tm.__name__,
                  "nncf_stub": isinstance(wrapper.telemetry, wrapper.NNCFTelemetryStub)}))
"""


def test_openvino_and_nncf_send_no_usage_data():
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "TF_BUILD", "JENKINS_URL", "PYTEST_CURRENT_TEST")}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {
        "ovc": "openvino.tools.ovc.telemetry_stub", "nncf_stub": True}
