"""Python client of Penumbra's public API (transport/penumbra.thrift).

    from penumbra_client import PenumbraClient, NotFound, job_result_error, job_status_name

    with PenumbraClient("127.0.0.1", 7700, api_key="my-key") as c:
        doc = c.put_document("manual", text=open("manual.txt").read())
        for delta, chunk in c.stream(c.generate([doc.id], text="What does it say?")):
            print(delta, end="", flush=True)
        print(chunk.usage)

        # A batch job (a coordinator started with --data-dir): items run in the
        # background; results are fetched once it is over.
        job = c.submit_job([{"custom_id": "q1", "document_ids": [doc.id], "text": "Who?", "max_new_tokens": 32},
                            ("q2", [doc.id], "Where?", {"max_new_tokens": 32})])
        job = c.wait_job(job.id, poll_s=1.0, timeout_s=600,
                         on_progress=lambda j: print(job_status_name(j.status), j.completed, "/", j.total))
        for r in c.job_results(job.id):      # by custom_id
            print(r.custom_id, r.text if r.ok else job_result_error(r))
        c.delete_job(job.id)

The Thrift code is generated from transport/*.thrift at build time (thrift
--gen py): this module finds it in $PENUMBRA_GEN_PY if set, else in
<repo>/build/transport/gen-py. It needs the Thrift Python library
(Debian: python3-thrift, importable by /usr/bin/python3).

Transport: one TSocket (over TLS with tls_ca) + TFramedTransport +
TBinaryProtocol connection per client object, opened on first use (or by
`open()`/`with`) and kept for every later call, long polls included (one TLS
handshake per client, not per call), with TCP_NODELAY. A client is NOT
thread-safe: use one per thread. After a transport error (refused, reset,
timeout) the connection is closed and the next call opens a new one.

TLS: give tls_ca (the CA of the coordinator's certificate; the certificate
must also name the host dialled and carry role coordinator), and
tls_cert/tls_key for a tenant that requires a client certificate. The API
key: api_key, else $PENUMBRA_API_KEY_FILE (a file holding it), else
$PENUMBRA_API_KEY. Scripts take the same as flags through
add_connection_args(parser) and client_from_args(args): --host, --port,
--api-key-file, --tls-ca, --tls-cert, --tls-key (never a key on a command
line).

Errors: every PenumbraError of the server is raised as a subclass of
PenumbraClientError named after its code (InvalidArgument, NotFound, ...);
transport errors (connection refused or lost, socket timeout) raise
Unavailable. A generation that fails after it started does not raise from
stream()/ask(): its last chunk is done with finish_reason "error" or
"deadline" and error_code/error_message set (see `chunk_error`).
"""

import argparse
import logging
import os
import socket
import ssl
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
JobStatus = api_types.JobStatus
JobInfo = api_types.JobInfo
JobItem = api_types.JobItem
JobItemResult = api_types.JobItemResult
JOB_FINAL_STATUSES = frozenset([JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED])

# $PENUMBRA_PORT, else 7700 (configs/service.yaml's, as the `penumbra` CLI).
DEFAULT_PORT = int(os.environ["PENUMBRA_PORT"]) if os.environ.get("PENUMBRA_PORT") else 7700

__all__ = [
    "PenumbraClient", "PenumbraClientError", "InvalidArgument", "NotFound", "PermissionDenied",
    "ResourceExhausted", "Unavailable", "DeadlineExceeded", "FailedPrecondition", "Cancelled", "Internal",
    "DocumentInfo", "DocumentState", "GenerateChunk", "ErrorCode", "chunk_error", "DEFAULT_PORT",
    "JobStatus", "JobInfo", "JobItem", "JobItemResult", "JOB_FINAL_STATUSES", "job_item", "job_status_name",
    "job_final", "job_result_error", "state_name", "api_key_from_env", "tls_context", "add_connection_args",
    "client_from_args", "api_key_from_args", "read_api_key_file", "refuse_api_key_flag",
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


# --------------------------------------------------------------------------- requests

# generate()'s keyword arguments (after document_ids), which job items take too.
GENERATE_OPTIONS = ("text", "token_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                    "stop_ids", "ignore_eos", "kv_policy")


def _generate_request(api_key, document_ids, text=None, token_ids=None, max_new_tokens=256, temperature=0.0,
                      top_k=0, top_p=1.0, seed=0, stop=(), stop_ids=(), ignore_eos=False, kv_policy="",
                      deadline_ms=0):
    if isinstance(document_ids, str):
        document_ids = [document_ids]
    if isinstance(stop, str):
        stop = [stop]
    return api_types.GenerateRequest(
        api_key=api_key,
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


def job_item(custom_id, document_ids, text=None, **options):
    """One item of a batch job: a generation named `custom_id` (unique in
    the job, 1..256 bytes), with generate()'s arguments (document ids, the
    question as text or token_ids=, max_new_tokens=, temperature=, stop=,
    ...). The job's key and completion window apply, so there is no
    deadline_ms."""
    unknown = sorted(set(options) - set(GENERATE_OPTIONS))
    if unknown:
        hint = " (the question is 'text')" if "question" in unknown else ""
        raise TypeError("job item %r: unknown option(s) %s%s; known: custom_id, document_ids, %s" %
                        (custom_id, ", ".join(unknown), hint, ", ".join(GENERATE_OPTIONS)))
    if not isinstance(custom_id, str):
        raise TypeError("job item: custom_id must be a str, got %r" % (custom_id,))
    return api_types.JobItem(custom_id=custom_id,
                             request=_generate_request("", document_ids, text=text, **options))


def _to_job_item(item):
    """A JobItem from a JobItem, a dict (custom_id, document_ids and
    generate()'s keyword arguments), or a tuple (custom_id, document_ids,
    text[, {options}])."""
    if isinstance(item, api_types.JobItem):
        return item
    if isinstance(item, dict):
        d = dict(item)
        if "custom_id" not in d or "document_ids" not in d:
            raise TypeError("job item %r: a dict needs custom_id and document_ids" % (item,))
        return job_item(d.pop("custom_id"), d.pop("document_ids"), **d)
    if isinstance(item, (tuple, list)) and len(item) in (3, 4):
        options = item[3] if len(item) == 4 else {}
        if not isinstance(options, dict):
            raise TypeError("job item %r: the 4th element must be a dict of options" % (item,))
        return job_item(item[0], item[1], item[2], **options)
    raise TypeError("job item %r: give a dict, a (custom_id, document_ids, text[, options]) tuple or a "
                    "job_item()" % (item,))


def job_status_name(status):
    """"COMPLETED" for JobStatus.COMPLETED, etc."""
    return JobStatus._VALUES_TO_NAMES.get(status, str(status))


def job_final(info_or_status):
    """Whether a job (a JobInfo, or its JobStatus) is over: COMPLETED,
    FAILED, CANCELLED or EXPIRED. (CANCELLING is not: items still run.)"""
    status = getattr(info_or_status, "status", info_or_status)
    return status in JOB_FINAL_STATUSES


def job_result_error(result):
    """The exception a JobItemResult that is not ok stands for (its
    error_code, else Internal; a cancelled item: Cancelled), or None."""
    if result is None or result.ok:
        return None
    code = result.error_code
    if code is None:
        code = ErrorCode.CANCELLED if result.state == "cancelled" else ErrorCode.INTERNAL
    return error_from_code(code, result.error or result.state or "failed")


# --------------------------------------------------------------------------- client


class _LenientBinaryProtocol(TBinaryProtocol.TBinaryProtocol):
    """TBinaryProtocol whose strings decode invalid UTF-8 (e.g. a character
    cut between two tokens) as U+FFFD instead of failing the call."""

    def readString(self):
        return self.readBinary().decode("utf-8", errors="replace")



def api_key_from_env():
    """The API key of $PENUMBRA_API_KEY_FILE (a file holding it), else
    $PENUMBRA_API_KEY, else ""."""
    path = os.environ.get("PENUMBRA_API_KEY_FILE")
    if path:
        return read_api_key_file(path)
    return os.environ.get("PENUMBRA_API_KEY", "")


def read_api_key_file(path):
    """The key a file holds (surrounding whitespace dropped). ValueError
    naming the file when it cannot be read or is empty (never its content)."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read(1 << 16).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError("the API key file %s: %s" % (path, getattr(e, "strerror", None) or e)) from None
    if not key:
        raise ValueError("the API key file %s is empty" % path)
    return key


def _readable(path, what):
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ValueError("TLS: the %s %s: %s" % (what, path, e.strerror or e)) from None


def tls_context(ca, cert=None, key=None):
    """An ssl.SSLContext for the public API: TLS 1.2 at least, the server's
    certificate checked against `ca` and the host dialled; a client
    certificate when `cert` and `key` are given. ValueError naming the file
    for one that is missing, unreadable or not what it should be, and for a
    key readable by group or others (the servers refuse theirs alike)."""
    _readable(ca, "CA")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    try:
        ctx.load_verify_locations(cafile=ca)
    except ssl.SSLError as e:
        raise ValueError("TLS: the CA %s: %s" % (ca, e)) from None
    if cert or key:
        if not (cert and key):
            raise ValueError("a client certificate needs both its certificate and its key")
        _readable(cert, "certificate")
        _readable(key, "key")
        if os.stat(key).st_mode & 0o077:
            raise ValueError("TLS: the key %s is readable by group or others; chmod 600 it" % key)
        try:
            ctx.load_cert_chain(certfile=cert, keyfile=key)
        except ssl.SSLError as e:
            raise ValueError("TLS: the certificate %s with the key %s: %s" % (cert, key, e)) from None
    return ctx


class _TlsRefused(Exception):
    """The TLS handshake or the server's certificate was refused."""


class _TlsSocket(TSocket.TSocket):
    """A TSocket over TLS: connects, runs the handshake (the SSL context
    checks the CA and the host), then checks the certificate's role
    (coordinator). Unlike Thrift's TSSLSocket it keeps why a handshake
    failed (Thrift's reports only that no address could be reached)."""

    def __init__(self, host, port, context):
        TSocket.TSocket.__init__(self, host, port)
        self._context = context

    def open(self):
        if self.handle:
            raise TTransport.TTransportException(TTransport.TTransportException.ALREADY_OPEN, "already open")
        last = None
        for family, socktype, _, _, sockaddr in socket.getaddrinfo(self.host, self.port, 0, socket.SOCK_STREAM):
            raw = socket.socket(family, socktype)
            raw.settimeout(self._timeout)
            try:
                raw.connect(sockaddr)
            except OSError as e:
                raw.close()
                last = e
                continue
            try:
                handle = self._context.wrap_socket(raw, server_hostname=self.host)
            except (ssl.SSLError, ssl.CertificateError) as e:
                raw.close()
                raise _TlsRefused("TLS handshake with %s:%d: %s" % (self.host, self.port, e)) from None
            except OSError as e:  # the server closed it during the handshake
                raw.close()
                raise _TlsRefused("TLS handshake with %s:%d: %s" % (self.host, self.port, e)) from None
            subject = dict(x[0] for x in handle.getpeercert().get("subject", ()))
            if subject.get("organizationalUnitName") != "coordinator":
                handle.close()
                raise _TlsRefused("the server at %s:%d is not a Penumbra coordinator (its certificate's role is %r)"
                                  % (self.host, self.port, subject.get("organizationalUnitName")))
            self.handle = handle
            return
        raise TTransport.TTransportException(TTransport.TTransportException.NOT_OPEN,
                                             "could not connect to %s:%d: %s" % (self.host, self.port, last))


def refuse_api_key_flag(ap):
    """Turns off ap's prefix matching (so that --api-key VALUE is not taken
    for --api-key-file) and refuses --api-key with a message that does not
    repeat its value: keys never go on a command line."""
    ap.allow_abbrev = False

    class _Refuse(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error("--api-key: an API key is never taken on the command line (other users can read it "
                         "there); give --api-key-file FILE, or set $PENUMBRA_API_KEY_FILE or $PENUMBRA_API_KEY")
    ap.add_argument("--api-key", action=_Refuse, help=argparse.SUPPRESS)


def add_connection_args(ap):
    """The flags of a script that talks to a coordinator, with the CLI's
    environment defaults: --host, --port, --api-key-file, --tls-ca,
    --tls-cert, --tls-key (and --api-key refused: refuse_api_key_flag)."""
    refuse_api_key_flag(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT, help="the coordinator's port (default: $PENUMBRA_PORT)")
    ap.add_argument("--api-key-file", default=os.environ.get("PENUMBRA_API_KEY_FILE"),
                    help="a file holding the API key (default $PENUMBRA_API_KEY_FILE, else the key in "
                         "$PENUMBRA_API_KEY)")
    ap.add_argument("--tls-ca", default=os.environ.get("PENUMBRA_TLS_CA"),
                    help="the CA of the coordinator's certificate: TLS on (default $PENUMBRA_TLS_CA)")
    ap.add_argument("--tls-cert", default=os.environ.get("PENUMBRA_TLS_CERT"),
                    help="a client certificate, for a tenant that requires one (default $PENUMBRA_TLS_CERT)")
    ap.add_argument("--tls-key", default=os.environ.get("PENUMBRA_TLS_KEY"),
                    help="its private key (default $PENUMBRA_TLS_KEY)")


def api_key_from_args(args):
    return read_api_key_file(args.api_key_file) if args.api_key_file else os.environ.get("PENUMBRA_API_KEY", "")


def client_from_args(args, **kwargs):
    """A PenumbraClient from add_connection_args' flags (kwargs: timeout_s,
    ...). ValueError naming a key or TLS file that cannot be used."""
    return PenumbraClient(args.host, args.port, api_key=api_key_from_args(args), tls_ca=args.tls_ca,
                          tls_cert=args.tls_cert, tls_key=args.tls_key, **kwargs)


class PenumbraClient(object):
    """One connection to a coordinator, acting for one API key (tenant).

    timeout_s: the socket timeout of ordinary calls. Calls that wait on the
    server get longer ones: poll() waits wait_ms + timeout_s; put_document
    (wait=True) and ask() wait deadline_ms + timeout_s when deadline_ms > 0,
    else long_call_timeout_s.

    Not thread-safe: use one client per thread.
    """

    def __init__(self, host="127.0.0.1", port=None, api_key=None, timeout_s=30.0,
                 long_call_timeout_s=600.0, tls_ca=None, tls_cert=None, tls_key=None):
        if port is None:
            port = DEFAULT_PORT
        if port is None:
            raise ValueError("PenumbraClient: give the coordinator's port (or set $PENUMBRA_PORT)")
        self.host = host
        self.port = int(port)
        self.api_key = api_key if api_key is not None else api_key_from_env()
        self.timeout_s = float(timeout_s)
        self.long_call_timeout_s = float(long_call_timeout_s)
        if (tls_cert or tls_key) and not tls_ca:
            raise ValueError("PenumbraClient: a client certificate needs the CA (tls_ca) too")
        self._tls = tls_context(tls_ca, tls_cert, tls_key) if tls_ca else None
        self._socket = None
        self._transport = None
        self._client = None

    # -- connection

    def open(self):
        """Connects (calls connect on first use anyway). Raises Unavailable."""
        if self._client is not None:
            return self
        sock = _TlsSocket(self.host, self.port, self._tls) if self._tls is not None else TSocket.TSocket(
            self.host, self.port)
        sock.setTimeout(self.timeout_s * 1000.0)
        transport = TTransport.TFramedTransport(sock)
        try:
            transport.open()
        except _TlsRefused as e:
            raise PermissionDenied("PERMISSION_DENIED", str(e)) from None
        except TTransport.TTransportException as e:
            raise Unavailable("UNAVAILABLE", "cannot connect to %s:%d: %s" % (self.host, self.port, e)) from None
        try:
            # Each call is one frame written at once, but a request should not
            # wait behind Nagle's algorithm for the previous reply's ACK.
            sock.handle.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):
            pass
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

    def put_document(self, name, text=None, token_ids=None, wait=True, deadline_ms=0, kv_policy=""):
        """Adds a document (text, or token ids: exactly one). wait=True returns
        once it is READY (or FAILED); wait=False at once (FACTORING).
        kv_policy "full", "shadowkv", "spindlekv" or "specontext" pins the document (and its questions)
        to that KV policy; "": the workers' choice."""
        req = api_types.PutDocumentRequest(
            api_key=self.api_key, name=name, text=text,
            token_ids=list(token_ids) if token_ids is not None else None,
            wait=bool(wait), deadline_ms=int(deadline_ms), kv_policy=str(kv_policy))
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
        return _generate_request(self.api_key, document_ids, text, token_ids, max_new_tokens, temperature, top_k,
                                 top_p, seed, stop, stop_ids, ignore_eos, kv_policy, deadline_ms)

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

    def stream(self, request_id, wait_ms=1000, offset=0, reconnect_s=30.0):
        """Yields (new_text, chunk) as tokens arrive, by long polling from token
        `offset`: new_text is the part of the answer's text not yielded before
        (chunk.text is the whole text so far; chunk.ids the ids from
        chunk.offset). The last chunk yielded is done (finish_reason, usage). A
        character whose bytes are not all out yet (U+FFFD at the end of the
        text) is held back until it is complete. A poll that fails with
        Unavailable (the connection lost, the coordinator restarting) is
        retried on a new connection at the same offset for reconnect_s seconds
        (a coordinator restarted on its data directory continues the request);
        0: raise at once."""
        offset = int(offset)
        sent = ""
        failing_since = None
        while True:
            try:
                chunk = self.poll(request_id, offset, wait_ms)
            except Unavailable:
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                if now - failing_since >= reconnect_s:
                    raise
                time.sleep(0.2)
                continue
            failing_since = None
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

    # -- batch jobs (a coordinator started with --data-dir; else FailedPrecondition)

    def submit_job(self, items, completion_window_s=0, metadata="", deadline_ms=0):
        """Submits a batch job; returns its JobInfo (id, status, counts).

        items: each a dict {"custom_id": ..., "document_ids": [...], "text":
        ..., and any other generate() keyword: "max_new_tokens",
        "temperature", "stop", ...}, a tuple (custom_id, document_ids, text)
        or (custom_id, document_ids, text, {options}), or a job_item().
        custom_ids are unique in the job. completion_window_s: 0 is 24 hours;
        items unfinished by then fail ("expired"). metadata: kept with the job.
        The whole job is refused (InvalidArgument, NotFound, ...) when an item
        is bad; the message names it. Not retried on a lost connection (the
        job may exist: see list_jobs)."""
        if isinstance(items, (dict, api_types.JobItem)):
            raise TypeError("submit_job: items is a list of items, got a single one")
        req = api_types.SubmitJobRequest(
            api_key=self.api_key, items=[_to_job_item(x) for x in items],
            completion_window_s=int(completion_window_s), metadata=metadata or "", deadline_ms=int(deadline_ms))
        return self._call("SubmitJob", req, timeout_s=self._wait_timeout(deadline_ms))

    def get_job(self, job_id):
        """The job's JobInfo: status (see job_status_name), total, pending,
        running, completed (succeeded), failed, cancelled, times, metadata."""
        return self._call("GetJob", self.api_key, job_id)

    def list_jobs(self, page_size=100):
        """Iterates over all of this tenant's jobs (oldest first), page by page."""
        token = ""
        while True:
            page = self._call("ListJobs", self.api_key, token, int(page_size))
            for j in page.jobs or []:
                yield j
            token = page.next_page_token or ""
            if not token:
                return

    def job_results(self, job_id, page_size=500, after_custom_id=""):
        """Iterates over the job's finished items' JobItemResults (custom_id,
        ok, state: "succeeded"/"failed"/"cancelled", text, ids,
        finish_reason, error_code, error, usage), by custom_id (bytewise),
        page by page from after `after_custom_id`. While the job runs, only
        the items finished so far; `list(...)` for all of them at once."""
        after = after_custom_id or ""
        while True:
            page = self._call("GetJobResults", self.api_key, job_id, after, int(page_size))
            for r in page.results or []:
                yield r
            after = page.next_after or ""
            if not after:
                return

    def cancel_job(self, job_id):
        """Cancels the job's pending items (running ones end first: CANCELLING,
        then CANCELLED); returns its JobInfo. FailedPrecondition when the job
        is already over."""
        return self._call("CancelJob", self.api_key, job_id)

    def delete_job(self, job_id):
        """Deletes a finished job and its results (FailedPrecondition while it
        runs: cancel it first)."""
        self._call("DeleteJob", self.api_key, job_id)

    def wait_job(self, job_id, poll_s=1.0, timeout_s=3600.0, on_progress=None):
        """Polls get_job every poll_s until the job is over (job_final) and
        returns its JobInfo; DeadlineExceeded after timeout_s.
        on_progress(info) is called with the first JobInfo and each one whose
        status or counts changed (the last one included)."""
        end = time.monotonic() + timeout_s
        last_key = None
        while True:
            info = self.get_job(job_id)
            key = (info.status, info.pending, info.running, info.completed, info.failed, info.cancelled)
            if on_progress is not None and key != last_key:
                on_progress(info)
            last_key = key
            if job_final(info):
                return info
            left = end - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded("DEADLINE_EXCEEDED", "job %s still %s after %.0f s (%d of %d items done)" % (
                    job_id, job_status_name(info.status), timeout_s, info.completed + info.failed + info.cancelled,
                    info.total))
            time.sleep(min(poll_s, left))

    # -- service

    def health(self):
        """HealthResponse: serving and the model's name (no API key needed). The
        workers are in stats(), shown to an admin tenant."""
        return self._call("Health")

    def stats(self):
        """StatsResponse of this tenant (requests, tokens, documents; the workers
        for an admin tenant or a coordinator without authentication)."""
        return self._call("Stats", self.api_key)


def state_name(state):
    """"READY" for DocumentState.READY, etc."""
    return DocumentState._VALUES_TO_NAMES.get(state, str(state))
