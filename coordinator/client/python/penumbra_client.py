"""Python client of Penumbra's public API (transport/penumbra.thrift).

    from penumbra_client import PenumbraClient, NotFound

    with PenumbraClient("127.0.0.1", 7700, api_key="my-key") as c:
        doc = c.put_document("manual", text=open("manual.txt").read())
        for delta, chunk in c.stream(c.generate([doc.id], text="What does it say?")):
            print(delta, end="", flush=True)
        print(chunk.usage)

The Thrift code is generated from transport/*.thrift at build time (thrift
--gen py): this module finds it in $PENUMBRA_GEN_PY if set, else in
<repo>/build/transport/gen-py. It needs the Thrift Python library
(Debian: python3-thrift, importable by /usr/bin/python3).

Transport: one TSocket + TFramedTransport + TBinaryProtocol connection per
client object, opened on first use (or by `open()`/`with`). A client is NOT
thread-safe: use one per thread. After a transport error (refused, reset,
timeout) the connection is closed and the next call opens a new one.

Errors: every PenumbraError of the server is raised as a subclass of
PenumbraClientError named after its code (InvalidArgument, NotFound, ...);
transport errors (connection refused or lost, socket timeout) raise
Unavailable. A generation that fails after it started does not raise from
stream()/ask(): its last chunk is done with finish_reason "error" or
"deadline" and error_code/error_message set (see `chunk_error`).
"""

import logging
import os
import socket
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
_DEFAULT_GEN_PY = os.path.join(_REPO, "build", "transport", "gen-py")


def _find_gen_py():
    env = os.environ.get("PENUMBRA_GEN_PY")
    path = env if env else _DEFAULT_GEN_PY
    return path, bool(env)


_GEN_PY, _GEN_PY_FROM_ENV = _find_gen_py()
if os.path.isdir(_GEN_PY) and _GEN_PY not in sys.path:
    sys.path.insert(0, _GEN_PY)

try:
    from thrift.Thrift import TApplicationException, TException
    from thrift.protocol import TBinaryProtocol
    from thrift.transport import TSocket, TTransport
except ImportError as e:  # pragma: no cover - environment problem
    raise ImportError(
        "penumbra_client needs the Thrift Python library (%s); on Debian install python3-thrift and run "
        "with /usr/bin/python3 (its site-packages), or pip install thrift==0.17.0" % e) from e

try:
    from penumbra.rpc.api import Penumbra as _PenumbraService
    from penumbra.rpc.api import ttypes as api_types
    from penumbra.rpc.common import ttypes as common_types
except ImportError as e:
    raise ImportError(
        "penumbra_client cannot import the generated Thrift code (penumbra.rpc.api, penumbra.rpc.common): %s. "
        "It is looked for in $PENUMBRA_GEN_PY (%s), else in %s, which the build generates from "
        "transport/penumbra.thrift and transport/common.thrift (or run: thrift --gen py -out DIR "
        "transport/penumbra.thrift; thrift --gen py -out DIR transport/common.thrift)." %
        (e, os.environ.get("PENUMBRA_GEN_PY", "not set"), _DEFAULT_GEN_PY)) from e

# TSocket logs failed connects itself; this client raises Unavailable instead.
# (A NullHandler keeps Python's last-resort handler from printing them; an
# application's own logging configuration still sees them.)
logging.getLogger("thrift").addHandler(logging.NullHandler())

DocumentInfo = api_types.DocumentInfo
DocumentState = api_types.DocumentState
GenerateChunk = api_types.GenerateChunk
ErrorCode = common_types.ErrorCode

# $PENUMBRA_PORT, else 7700 (configs/service.yaml's, as the `penumbra` CLI).
DEFAULT_PORT = int(os.environ["PENUMBRA_PORT"]) if os.environ.get("PENUMBRA_PORT") else 7700

__all__ = [
    "PenumbraClient", "PenumbraClientError", "InvalidArgument", "NotFound", "PermissionDenied",
    "ResourceExhausted", "Unavailable", "DeadlineExceeded", "FailedPrecondition", "Cancelled", "Internal",
    "DocumentInfo", "DocumentState", "GenerateChunk", "ErrorCode", "chunk_error", "DEFAULT_PORT",
]


# --------------------------------------------------------------------------- errors


class PenumbraClientError(Exception):
    """A failed call. code_name: the ErrorCode's name ("NOT_FOUND", ...);
    retry_after_ms: when to retry (RESOURCE_EXHAUSTED), else None."""

    code_name = "UNKNOWN"

    def __init__(self, code_name, message, retry_after_ms=None):
        super().__init__("%s: %s" % (code_name, message))
        self.code_name = code_name
        self.message = message
        self.retry_after_ms = retry_after_ms

    @property
    def code(self):
        """The ErrorCode value, or None for a code this client does not know."""
        return ErrorCode._NAMES_TO_VALUES.get(self.code_name)


class InvalidArgument(PenumbraClientError):
    pass


class NotFound(PenumbraClientError):
    pass


class PermissionDenied(PenumbraClientError):
    pass


class ResourceExhausted(PenumbraClientError):
    pass


class Unavailable(PenumbraClientError):
    pass


class DeadlineExceeded(PenumbraClientError):
    pass


class FailedPrecondition(PenumbraClientError):
    pass


class Cancelled(PenumbraClientError):
    pass


class Internal(PenumbraClientError):
    pass


_CLASS_BY_CODE = {
    "INVALID_ARGUMENT": InvalidArgument,
    "NOT_FOUND": NotFound,
    "PERMISSION_DENIED": PermissionDenied,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "FAILED_PRECONDITION": FailedPrecondition,
    "CANCELLED": Cancelled,
    "INTERNAL": Internal,
}


def _code_name(code):
    if code is None:
        return "INTERNAL"
    return ErrorCode._VALUES_TO_NAMES.get(code, "CODE_%d" % code)


def error_from_code(code, message, retry_after_ms=None):
    """The client exception for an ErrorCode value (unknown codes: Internal)."""
    name = _code_name(code)
    cls = _CLASS_BY_CODE.get(name, Internal)
    return cls(name, message or "", retry_after_ms)


def chunk_error(chunk):
    """The exception a finished chunk's error stands for (finish_reason "error"
    or "deadline"), or None when the generation did not fail."""
    if chunk is None or not chunk.done:
        return None
    if chunk.error_code is None and chunk.finish_reason not in ("error", "deadline"):
        return None
    code = chunk.error_code
    if code is None:
        code = ErrorCode.DEADLINE_EXCEEDED if chunk.finish_reason == "deadline" else ErrorCode.INTERNAL
    return error_from_code(code, chunk.error_message or chunk.finish_reason)


# --------------------------------------------------------------------------- client


class _LenientBinaryProtocol(TBinaryProtocol.TBinaryProtocol):
    """TBinaryProtocol whose strings decode invalid UTF-8 (e.g. a character
    cut between two tokens) as U+FFFD instead of failing the call."""

    def readString(self):
        return self.readBinary().decode("utf-8", errors="replace")



class PenumbraClient(object):
    """One connection to a coordinator, acting for one API key (tenant).

    timeout_s: the socket timeout of ordinary calls. Calls that wait on the
    server get longer ones: poll() waits wait_ms + timeout_s; put_document
    (wait=True) and ask() wait deadline_ms + timeout_s when deadline_ms > 0,
    else long_call_timeout_s.

    Not thread-safe: use one client per thread.
    """

    def __init__(self, host="127.0.0.1", port=None, api_key="", timeout_s=30.0,
                 long_call_timeout_s=600.0):
        if port is None:
            port = DEFAULT_PORT
        if port is None:
            raise ValueError("PenumbraClient: give the coordinator's port (or set $PENUMBRA_PORT)")
        self.host = host
        self.port = int(port)
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.long_call_timeout_s = float(long_call_timeout_s)
        self._socket = None
        self._transport = None
        self._client = None

    # -- connection

    def open(self):
        """Connects (calls connect on first use anyway). Raises Unavailable."""
        if self._client is not None:
            return self
        sock = TSocket.TSocket(self.host, self.port)
        sock.setTimeout(self.timeout_s * 1000.0)
        transport = TTransport.TFramedTransport(sock)
        try:
            transport.open()
        except TTransport.TTransportException as e:
            raise Unavailable("UNAVAILABLE", "cannot connect to %s:%d: %s" % (self.host, self.port, e)) from None
        self._socket = sock
        self._transport = transport
        self._client = _PenumbraService.Client(_LenientBinaryProtocol(transport))
        return self

    def close(self):
        if self._transport is not None:
            try:
                self._transport.close()
            except Exception:
                pass
        self._socket = self._transport = self._client = None

    def __enter__(self):
        return self.open()

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _call(self, method, *args, timeout_s=None):
        """Runs one rpc, mapping its errors to the client's exceptions.

        The exception is raised outside the except blocks, so it has no
        __context__: the Thrift exceptions are immutable, and tools that
        rewrite a chain's tracebacks (unittest does) would fail on them."""
        self.open()
        self._socket.setTimeout((timeout_s if timeout_s is not None else self.timeout_s) * 1000.0)
        finished = False  # the reply was read whole: the connection is in step
        err = None
        try:
            result = getattr(self._client, method)(*args)
            finished = True
            return result
        except common_types.PenumbraError as e:
            finished = True
            err = error_from_code(e.code, e.message, e.retry_after_ms)
        except (TTransport.TTransportException, socket.error, EOFError) as e:
            inner = getattr(e, "inner", None)
            timed_out = (isinstance(e, socket.timeout) or isinstance(inner, socket.timeout) or
                         getattr(e, "type", None) == TTransport.TTransportException.TIMED_OUT)
            detail = "%s (%s)" % (e, inner) if inner is not None else str(e)
            err = Unavailable("UNAVAILABLE", "%s to %s:%d %s: %s" % (
                method, self.host, self.port, "timed out" if timed_out else "failed", detail))
        except TApplicationException as e:
            err = Internal("INTERNAL", "%s: server application error: %s" % (method, e))
        except (TException, UnicodeDecodeError) as e:
            err = Internal("INTERNAL", "%s: protocol error: %s" % (method, e))
        finally:
            if not finished:
                # Anything that interrupted the call (a transport error, a
                # timeout, KeyboardInterrupt) leaves the connection out of
                # step (a reply may still come): drop it; the next call
                # reconnects.
                self.close()
            elif self._socket is not None:
                self._socket.setTimeout(self.timeout_s * 1000.0)
        raise err

    def _wait_timeout(self, deadline_ms):
        if deadline_ms and deadline_ms > 0:
            return deadline_ms / 1000.0 + self.timeout_s
        return self.long_call_timeout_s

    # -- documents

    def put_document(self, name, text=None, token_ids=None, wait=True, deadline_ms=0):
        """Adds a document (text, or token ids: exactly one). wait=True returns
        once it is READY (or FAILED); wait=False at once (FACTORING)."""
        req = api_types.PutDocumentRequest(
            api_key=self.api_key, name=name, text=text,
            token_ids=list(token_ids) if token_ids is not None else None,
            wait=bool(wait), deadline_ms=int(deadline_ms))
        return self._call("PutDocument", req, timeout_s=self._wait_timeout(deadline_ms) if wait else None)

    def get_document(self, document_id, deadline_ms=0):
        return self._call("GetDocument", self.api_key, document_id, int(deadline_ms))

    def wait_document(self, document_id, timeout_s=600.0, interval_s=0.2):
        """Polls get_document until the document is no longer FACTORING."""
        end = time.monotonic() + timeout_s
        while True:
            info = self.get_document(document_id)
            if info.state != DocumentState.FACTORING:
                return info
            if time.monotonic() > end:
                raise DeadlineExceeded("DEADLINE_EXCEEDED",
                                       "document %s still factoring after %.0f s" % (document_id, timeout_s))
            time.sleep(interval_s)

    def list_documents(self, page_size=100, deadline_ms=0):
        """Iterates over all of this tenant's documents, page by page."""
        token = ""
        while True:
            req = api_types.ListDocumentsRequest(api_key=self.api_key, page_token=token,
                                                 page_size=int(page_size), deadline_ms=int(deadline_ms))
            page = self._call("ListDocuments", req)
            for d in page.documents or []:
                yield d
            token = page.next_page_token or ""
            if not token:
                return

    def delete_document(self, document_id, deadline_ms=0):
        self._call("DeleteDocument", self.api_key, document_id, int(deadline_ms))

    # -- generation

    def _generate_request(self, document_ids, text=None, token_ids=None, max_new_tokens=256, temperature=0.0,
                          top_k=0, top_p=1.0, seed=0, stop=(), stop_ids=(), ignore_eos=False, kv_policy="",
                          deadline_ms=0):
        if isinstance(document_ids, str):
            document_ids = [document_ids]
        if isinstance(stop, str):
            stop = [stop]
        return api_types.GenerateRequest(
            api_key=self.api_key,
            document_ids=list(document_ids or []),
            text=text,
            token_ids=list(token_ids) if token_ids is not None else None,
            max_new_tokens=int(max_new_tokens),
            sampling=common_types.SamplingOptions(temperature=float(temperature), top_k=int(top_k),
                                                  top_p=float(top_p), seed=int(seed)),
            stop=list(stop or []),
            stop_ids=list(stop_ids or []),
            ignore_eos=bool(ignore_eos),
            kv_policy=kv_policy or "",
            deadline_ms=int(deadline_ms))

    def generate(self, document_ids, text=None, token_ids=None, max_new_tokens=256, temperature=0.0, top_k=0,
                 top_p=1.0, seed=0, stop=(), stop_ids=(), ignore_eos=False, kv_policy="", deadline_ms=0):
        """Starts a generation after the documents (ids, in order) and the
        question (text, or token ids); returns its request id (see stream/poll)."""
        req = self._generate_request(document_ids, text, token_ids, max_new_tokens, temperature, top_k, top_p,
                                     seed, stop, stop_ids, ignore_eos, kv_policy, deadline_ms)
        return self._call("Generate", req)

    def poll(self, request_id, offset=0, wait_ms=1000):
        """The answer from `offset` (tokens), waiting up to wait_ms for more."""
        wait_ms = int(wait_ms)
        return self._call("Poll", self.api_key, request_id, int(offset), wait_ms,
                          timeout_s=max(wait_ms, 0) / 1000.0 + self.timeout_s)

    def stream(self, request_id, wait_ms=1000):
        """Yields (new_text, chunk) as tokens arrive, by long polling: new_text
        is the part of the answer's text not yielded before (chunk.text is the
        whole text so far; chunk.ids the ids from chunk.offset). The last
        chunk yielded is done (finish_reason, usage). A character whose bytes
        are not all out yet (U+FFFD at the end of the text) is held back until
        it is complete."""
        offset = 0
        sent = ""
        while True:
            chunk = self.poll(request_id, offset, wait_ms)
            ids = chunk.ids or []
            text = chunk.text or ""
            if not chunk.done:
                text = text.rstrip("\ufffd")
            if text.startswith(sent):
                delta = text[len(sent):]
            else:
                # The server revised text it had sent before (it should not):
                # nothing is yielded for this chunk; later deltas follow the
                # revised text.
                delta = ""
            sent = text
            if chunk.offset is not None and ids:
                offset = chunk.offset + len(ids)
            if ids or delta or chunk.done:
                yield delta, chunk
            if chunk.done:
                return

    def ask(self, document_ids, text=None, token_ids=None, max_new_tokens=256, temperature=0.0, top_k=0,
            top_p=1.0, seed=0, stop=(), stop_ids=(), ignore_eos=False, kv_policy="", deadline_ms=0):
        """Generates and waits for the end (one Complete call); returns the
        whole answer as a GenerateChunk (text, ids, finish_reason, usage)."""
        req = self._generate_request(document_ids, text, token_ids, max_new_tokens, temperature, top_k, top_p,
                                     seed, stop, stop_ids, ignore_eos, kv_policy, deadline_ms)
        return self._call("Complete", req, timeout_s=self._wait_timeout(deadline_ms))

    def cancel(self, request_id):
        self._call("Cancel", self.api_key, request_id)

    # -- service

    def health(self):
        """HealthResponse: serving, model, workers (no API key needed)."""
        return self._call("Health")

    def stats(self):
        """StatsResponse of this tenant (requests, tokens, documents, workers)."""
        return self._call("Stats", self.api_key)


def state_name(state):
    """"READY" for DocumentState.READY, etc."""
    return DocumentState._VALUES_TO_NAMES.get(state, str(state))
