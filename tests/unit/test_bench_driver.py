"""The benchmark driver's own parts: its job poster (bench.lean_http) and its reading of where a
repetition's time went (bench.run._engine_time_lines)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from bench.lean_http import JobPoster
from bench.run import Arm, _engine_time_lines


class _Jobs(BaseHTTPRequestHandler):
    """Answers POST /v1/jobs with 202 and the body it got; closes the connection after every
    ``close_every``-th request, as a server's keep-alive timeout does to an idle client."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[tuple[str, str, dict[str, object]]]] = []
    count = 0
    close_every = 0
    connections = 0

    def setup(self) -> None:
        _Jobs.connections += 1
        super().setup()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Jobs.seen.append((self.headers["Idempotency-Key"], self.headers["Authorization"], body))
        _Jobs.count += 1
        reply = json.dumps({"id": f"job_{_Jobs.count}"}).encode()
        self.send_response(202)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
        if _Jobs.close_every and _Jobs.count % _Jobs.close_every == 0:
            self.close_connection = True

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[str]:
    _Jobs.seen, _Jobs.count, _Jobs.close_every, _Jobs.connections = [], 0, 0, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Jobs)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_the_poster_sends_each_body_with_its_own_idempotency_key_and_the_headers(server: str) -> None:
    poster = JobPoster(server, {"Authorization": "Bearer k"})
    replies = [poster.post("/v1/jobs", {"prompt": f"p{i}"}) for i in range(3)]
    assert [(code, json.loads(body)["id"]) for code, body in replies] == [(202, "job_1"), (202, "job_2"),
                                                                          (202, "job_3")]
    assert [body for _key, _auth, body in _Jobs.seen] == [{"prompt": "p0"}, {"prompt": "p1"}, {"prompt": "p2"}]
    assert {auth for _key, auth, _body in _Jobs.seen} == {"Bearer k"}
    assert len({key for key, _auth, _body in _Jobs.seen}) == 3


def test_a_connection_the_server_closed_is_opened_again_and_no_job_is_sent_twice(server: str) -> None:
    _Jobs.close_every = 2
    poster = JobPoster(server)
    codes = [poster.post("/v1/jobs", {"prompt": f"p{i}"})[0] for i in range(6)]
    assert codes == [202] * 6
    assert [body["prompt"] for _key, _auth, body in _Jobs.seen] == [f"p{i}" for i in range(6)]
    assert _Jobs.connections == 3  # two requests on each; the poster found each closed one and opened another


def test_the_poster_refuses_what_it_cannot_reach_plainly() -> None:
    with pytest.raises(ValueError, match="plain http://"):
        JobPoster("https://example.com")


def test_each_repetition_reads_as_engine_time_plus_idle_beside_the_direct_call() -> None:
    system, direct = Arm(), Arm()
    system.jobs_per_s = [32.0, 25.6]  # 64 jobs a repetition: spans 2.0 and 2.5 s
    system.engine_run_s = {"dit": [1.9, 2.2]}
    direct.stage_s = {"dit": [1.8, 2.0]}
    (line,) = _engine_time_lines(system, direct, 64)
    assert line == ("engine time, dit: span 2.000 = engine 1.900 + idle 0.100 s (direct 1.800: run/direct 1.056); "
                    "span 2.500 = engine 2.200 + idle 0.300 s (direct 2.000: run/direct 1.100)")
