"""The bootstrap service: how a decode server meets a prefill server (HTTP + JSON, port 8998).

A prefill server runs one. A decode server (1) reads its KV layout and Mooncake session
(`GET /v1/layout`), (2) registers its own KV pool (one buffer per tensor-parallel rank, together
holding every KV head once) and arrival-record buffer once (`POST /v1/peers`), then (3) per
request registers the destination pages under the request's `bootstrap_room` (`POST /v1/rooms`):
those of the prompt pages after the `skip_pages` leading ones its prefix cache holds already
(non-zero only with a prefill that lists `skip_pages` in its `features`). It polls room states
(`POST /v1/status`), may cancel a room (`POST /v1/rooms/<room>/cancel`), checks the prefill is
alive (`POST /v1/heartbeat`) and says goodbye when it shuts down (`POST /v1/peers/leave`);
`GET /v1/peers` lists the decodes registered now. KV itself never passes through here: prefill writes it with Mooncake one-sided
writes.

Authentication: a prefill started with `--bootstrap-token-file` answers only calls that carry one
of the file's tokens (`Authorization: Bearer <token>`, compared in constant time); any other call
gets 401 with reason `missing_token` or `wrong_token`, is counted
(`tandem_bootstrap_refused_total{reason}`), and reaches no room, page or peer. `/health` stays
open: it tells nothing but that the service is up. A decode presents its file's first token on
every call; a prefill without a token file answers it anyway, so a rollout that adds tokens can
give the decodes theirs first.

Identity: both processes get an instance id on each start. Every answer of this service carries
the prefill's (`instance`), so a decode sees at once that the process behind an address was
replaced. Errors carry the table's refusal `reason` (prefill_rooms.py) with their HTTP status: 404
`unknown_peer`, 503 `leaving`, 409 `layout`; 400 for a malformed body.
"""

from __future__ import annotations

import hmac
import http.client
import ipaddress
import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tandem.server.disagg.layout import KVBuffer, KVLayout, LayoutMismatch
from tandem.server.disagg.prefill_rooms import PeerRefused, PrefillRoomTable, RoomState

log = logging.getLogger("tandem.bootstrap")

# What this prefill understands beyond the first protocol, in its layout answer: a decode uses a
# feature only with a prefill that lists it (a rolling upgrade pairs old and new processes).
FEATURES = ["skip_pages"]  # rooms may register destinations for the prompt's later pages only


REFUSALS = ("missing_token", "wrong_token")  # why an unauthenticated call was refused (a metric label)
DISCARD_LIMIT = 1 << 20  # a refused call's body up to this size is read (and dropped) before the answer


def is_loopback(host: str) -> bool:
    """Whether listening on `host` keeps a service to this machine (a loopback address or name)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authorization(token: str | None) -> dict[str, str]:
    """The header a bootstrap call carries with `token` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class _Handler(BaseHTTPRequestHandler):
    table: PrefillRoomTable  # set on the per-server subclass
    tokens: tuple[bytes, ...] = ()  # accepted bearer tokens; empty: anyone may call

    def log_message(self, fmt, *args):  # route http.server's access log to logging, quietly
        log.debug(fmt, *args)

    def _refusal(self) -> str | None:
        """Why this call may not proceed (a REFUSALS entry), or None. Every accepted token is
        compared, each in constant time, so the time taken tells nothing of how close a guess was."""
        if not self.tokens or self.path == "/health":
            return None
        scheme, _, presented = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return "missing_token"
        matches = [hmac.compare_digest(presented.strip().encode(), token) for token in self.tokens]
        return None if any(matches) else "wrong_token"

    def _authorized(self) -> bool:
        reason = self._refusal()
        if reason is None:
            return True
        refused = self.table.count_refusal(reason)
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and 0 < int(length) <= DISCARD_LIMIT:  # read, never parsed: a reset would hide the 401
            self.rfile.read(int(length))
        if refused & (refused - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood of refusals cannot flood the log
            log.warning("bootstrap call %s %s from %s refused: %s (%d so far)", self.command, self.path,
                        self.client_address[0], reason, refused)
        what = ("carried no bootstrap token" if reason == "missing_token"
                else "carried a bootstrap token this prefill does not accept")
        data = json.dumps({"error": f"the call {what}: this prefill requires one (--bootstrap-token-file)",
                           "reason": reason}).encode()
        self.send_response(401)
        self.send_header("WWW-Authenticate", "Bearer")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True
        return False

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps({**body, "instance": self.table.instance}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if not self._authorized():
            return
        if self.path == "/v1/layout":
            self._reply(200, {"layout": self.table.layout.to_json(), "session": self.table.session,
                              "kv_heads": self.table.kv_heads, "features": FEATURES})
        elif self.path == "/v1/peers":
            self._reply(200, {"peers": self.table.peers()})
        elif self.path == "/health":
            self._reply(200, {"ok": True})
        else:
            self._reply(404, {"error": f"no such path {self.path}"})

    def do_POST(self):
        if not self._authorized():  # before the body is parsed: a refused caller's bytes never are
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/v1/peers":
                self.table.add_peer(body)
                self._reply(200, {"ok": True})
            elif self.path == "/v1/peers/leave":
                self._reply(200, {"failed_rooms": self.table.remove_peer(body["decode"], body["decode_instance"])})
            elif self.path == "/v1/heartbeat":
                self._reply(200, self.table.heartbeat(body["decode"], body["decode_instance"]))
            elif self.path == "/v1/rooms":
                room = self.table.register(body)
                if room.state is RoomState.FAILED:
                    self._reply(409, {"error": room.message})
                else:
                    self._reply(200, {"state": room.state.value})
            elif self.path == "/v1/status":
                self._reply(200, self.table.status([int(r) for r in body["rooms"]], body.get("decode", "")))
            elif self.path.startswith("/v1/rooms/") and self.path.endswith("/cancel"):
                room_id = int(self.path.split("/")[3])
                state = self.table.cancel(room_id, body.get("message", "cancelled by the decode side"))
                self._reply(200, {"state": state.value})
            else:
                self._reply(404, {"error": f"no such path {self.path}"})
        except LayoutMismatch as e:
            self._reply(409, {"error": str(e), "reason": "layout"})
        except PeerRefused as e:
            self._reply(404 if e.reason == "unknown_peer" else 503, {"error": str(e), "reason": e.reason})
        except KeyError as e:
            self._reply(400, {"error": f"missing field {e.args[0]!r}"})
        except (ValueError, TypeError) as e:
            self._reply(400, {"error": str(e)})


class BootstrapService:
    """The HTTP server around a PrefillRoomTable, on its own daemon threads."""

    def __init__(self, table: PrefillRoomTable, host: str, port: int, tokens: list[str] = ()):
        """`tokens`: the bearer tokens a call must carry one of (none: every call is answered)."""
        handler = type("BootstrapHandler", (_Handler,), {"table": table, "tokens": tuple(t.encode() for t in tokens)})
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise OSError(f"--bootstrap-port {port}: cannot listen on {host}:{port}: {e}") from e
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="tandem-bootstrap", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class BootstrapError(RuntimeError):
    """A bootstrap call failed. `unreachable`: no answer at all (the peer may be dead);
    `refused`: nothing listens at the address (no process there can still write KV);
    `reason`: the service's own refusal reason (see the module doc); `instance`: the answering
    prefill's instance id, when it answered."""

    def __init__(self, message: str, unreachable: bool = False, refused: bool = False, reason: str = "",
                 instance: str = ""):
        super().__init__(message)
        self.unreachable = unreachable
        self.refused = refused
        self.reason = reason
        self.instance = instance

    @property
    def conflict(self) -> bool:
        """The two sides can never work together (KV layouts differ, a wrong room, or the decode
        lacks the prefill's bootstrap token)."""
        return self.reason in ("layout", "conflict", *REFUSALS)


class BootstrapClient:
    """The decode side's calls to one prefill's bootstrap service. Every answer is a dict with
    the prefill's `instance`."""

    def __init__(self, host: str, port: int, timeout: float = 5.0, token: str | None = None):
        """`token`: presented on every call (--bootstrap-token-file's first line)."""
        self.address = f"{host}:{port}"
        self.base = f"http://{host}:{port}"
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", **authorization(token)}

    def _call(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data, self.headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            try:
                answer = json.load(e)
            except ValueError:
                answer = {"error": e.reason}
            reason = answer.get("reason") or ("conflict" if e.code == 409 else "")
            raise BootstrapError(f"bootstrap service {self.address}: {answer.get('error', '')}", reason=reason,
                                 instance=answer.get("instance", "")) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
            # No answer, or half of one (the process died while it answered: IncompleteRead, a
            # truncated body): the peer may be dead either way.
            reason = getattr(e, "reason", e)
            raise BootstrapError(f"bootstrap service {self.address} unreachable: {reason}", unreachable=True,
                                 refused=isinstance(reason, ConnectionRefusedError)) from None

    def layout(self) -> dict:
        """{"layout": KVLayout, "session", "instance", "kv_heads": [[first head, heads] per rank],
        "features": [names]} (no features from a prefill older than them)"""
        body = self._call("/v1/layout")
        return {"features": [], **body, "layout": KVLayout.from_json(body["layout"])}

    def add_peer(self, me: dict, session: str, layout: KVLayout, parts: list[KVBuffer], record_base: int) -> dict:
        """`me`: {"decode": name, "decode_instance": id}, sent with every call that names the decode."""
        return self._call("/v1/peers", {**me, "session": session, "layout": layout.to_json(),
                                        "kv_parts": [p.to_json() for p in parts], "record_base": record_base})

    def register(self, me: dict, room: int, request_id: str, prompt_len: int, digest: int,
                 pages: list[int], record_slot: int, skip_pages: int = 0) -> dict:
        """`pages`: destinations of the prompt's pages after its first `skip_pages`."""
        return self._call("/v1/rooms", {**me, "room": room, "request_id": request_id, "prompt_len": prompt_len,
                                        "digest": digest, "pages": pages, "record_slot": record_slot,
                                        "skip_pages": skip_pages})

    def cancel(self, room: int, message: str) -> str:
        return self._call(f"/v1/rooms/{room}/cancel", {"message": message})["state"]

    def status(self, me: dict, rooms: list[int]) -> dict:
        """{"rooms": {room: {"state": RoomState, "message", "code"}}, "leaving", "instance"}"""
        body = self._call("/v1/status", {"decode": me["decode"], "rooms": rooms})
        return {**body, "rooms": {int(r): {**v, "state": RoomState(v["state"])} for r, v in body["rooms"].items()}}

    def heartbeat(self, me: dict) -> dict:
        """{"known": our registration is there, "leaving", "instance"}"""
        return self._call("/v1/heartbeat", me)

    def leave(self, me: dict, timeout: float) -> dict:
        return self._call("/v1/peers/leave", me, timeout=timeout)
