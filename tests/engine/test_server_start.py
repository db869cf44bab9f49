"""``VLLMServer.start`` against stand-in server processes (no vLLM): a start that died of vLLM's
engine-core handshake timeout is started once more; any other death is reported at once."""
from __future__ import annotations

import sys

import pytest

from skyrl_numerics.engine.server import HANDSHAKE_TIMEOUT, VLLMServer, free_port

# dies like vLLM's engine core on the first run (a marker file remembers it), then serves /health
STAND_IN = """
import http.server, os, sys
marker, port, line = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if not os.path.exists(marker):
    open(marker, "w").close()
    print("(EngineCore pid=1) ERROR [core.py:1510]     " + line, flush=True)
    sys.exit(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _server(model_dir, tmp_path, line: str) -> VLLMServer:
    srv = VLLMServer(model_dir, log_path=tmp_path / "serve.log", port=free_port())
    srv.argv = [sys.executable, "-c", STAND_IN, str(tmp_path / "died-once"), str(srv.port), line]
    return srv


def test_a_handshake_timeout_is_started_once_more(qwen_moe_dir, tmp_path, capsys):
    srv = _server(qwen_moe_dir, tmp_path, HANDSHAKE_TIMEOUT)
    try:
        assert srv.start(timeout=30) is srv and srv.alive()
    finally:
        srv.stop()
    assert "handshake timed out under load; starting again" in capsys.readouterr().err


def test_any_other_death_is_reported_at_once(qwen_moe_dir, tmp_path):
    srv = _server(qwen_moe_dir, tmp_path, "ValueError: something else")
    with pytest.raises(RuntimeError, match="(?s)exited with code 1 while starting.*something else"):
        srv.start(timeout=30)
    assert not srv.alive()
