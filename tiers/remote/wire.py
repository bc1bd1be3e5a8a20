"""The L3 tier's redis-py connections: how values go out and replies come in.

Sending a framed value without first copying it into one buffer: a stored value is a 32-byte
header followed by the block's bytes (``codec``). The bytes live in the caller's buffer (an
L1 slot); joining header and bytes into one contiguous value costs a full copy of the block
before redis-py copies it again into its send buffer. Instead, a ``Framed`` argument goes out
as two chunks of one RESP bulk string (``$<len>\\r\\n``, the header, the bytes, ``\\r\\n``):
on the wire it is the same value.

Sending a pipeline's chunks one by one: redis-py hands a command's chunks to the stream's
``writelines``, which on Python 3.11 and earlier joins them into one new bytes object before
the transport sends or buffers it: for a pipeline of 2 MiB values, a fresh allocation and a
copy of every byte, on the event loop, before the first one leaves. Written one at a time,
a chunk goes to the socket as it is, and only what the socket does not take is buffered.

Not sending a body after its call has ended: a transport may hold what the socket has not
taken yet by reference (uvloop's do; asyncio's own copies it), and a pipeline that fails (a
timeout against a hung store, a cancel) hands its buffers back while its connection still
holds them: once the store read again, their new bytes (another block's, another tenant's)
went out under the old key and header. ``releasing_bodies`` aborts, when the pipeline it
wraps fails, every transport a ``Framed`` body was written to, so that none of it goes out
later.

Answering a node's connection fault in place of its commands' replies: a cluster pipeline
sends each node's commands over one connection of that node, in parallel, and redis-py fails
the whole pipeline when sending to one node fails (a connection refused or reset: a master
that just died), after closing every connection of the client, those of other calls in flight
included, for one retry; the other nodes' replies were lost with it. Within
``noting_node_faults``, such a fault of a send is answered by each of that node's commands
instead (as a fault met reading the replies already is), so the other nodes' replies come
back, and every connection fault met is noted with its node for the caller to judge. Only
faults of the connection itself; a refused credential fails the pipeline as before. Only the
caller's send answers: redis-py's handshake of a fresh connection, sent within it, sends
twice before it reads and must see its faults raised (the connect fails, and that send
answers it).

A node that does not answer in time is such a fault too. Within ``noting_node_faults`` with a
deadline (``NodeFaults.deadline``), a send gives the waits of its connection (its connect and
handshake, the send, each reply read after it) the time left to the deadline as it begins,
where that is shorter than the socket and connect timeouts: redis-py times each of these
waits anyway, so no timer of our own is set per reply. A silent node's first wait ends by the
deadline with a ``TimeoutError`` noted with its node, which its other replies answer at once.
A hung master (a stopped process, a host gone) then costs its own commands, and the other
nodes' replies come back within the same deadline; bounded as a whole instead, the pipeline
lost them all. (A node that sends its replies slowly, one by one, may outlast the deadline:
the caller's bound of the whole pipeline then ends it, as before.)
A connection that timed out is aborted, not closed: a graceful close sends what its
transport still holds (a body's last bytes, by reference) once the node reads again, after
the caller has its buffers back.

Connecting afresh where the server closed a connection while it idled in the pool (its
``timeout``, CLIENT KILL, a restart): redis-py's own pool checks a connection as it hands it
out, a cluster node's pool does not, and a pipeline sent over it read the EOF, its master
taken as lost although it served. A send over a stream that has seen the server's EOF (or
lost its connection) connects first.

Receiving large replies with fewer steps: the stream buffers more before it pauses the
socket (redis-py's streams pause at 128 KiB and resume at 64 KiB, two selector changes per
socket read of a 2 MiB value), and hiredis keeps its reply buffer between replies of a few
MiB instead of freeing it after each and growing it again, copy by copy, for the next.

Sending a cluster redirection's ``ASKING`` on the connection of the command it is for: on an
``ASK`` reply redis-py's cluster client sends ``ASKING``, then the command, each through its own
call that takes a free connection of the node's pool, the oldest first, so with more than one
free the command went out on another connection than its ``ASKING``; the importing node
answered it ``MOVED`` back to the old owner, which answered ``ASK`` again, until the client gave
up: while a slot migrated, a key already moved was a failed read, write or removal (and an
unknown probe) on any node the tier had used in parallel. The ``ASKING`` is held back instead
and sent just before the next command of the same task, on that command's connection.

redis-py packs, sends and parses in its connection class (``pack_command``,
``_send_packed_command``, ``_connection_arguments``, ``set_parser``; pipelines go through them
too). ``use_tier_connections`` gives a client's connections a subclass that does the above;
everything else is redis-py's own. The client's internals it relies on are checked when it is
installed (``TierConnectionUnavailable``), never guessed at on the wire; of the send and
receive steps, one that a redis-py version does not call through these methods is simply its
own (slower, never wrong).

Thread-safety: ``Framed`` is immutable; ``use_tier_connections`` is called once per client,
before its first command.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

from redis._parsers import _AsyncHiredisParser
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection
from redis.exceptions import AuthenticationError, AuthorizationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# What the stream of a connection holds before it pauses reading the socket (it pauses at
# twice this): a pipeline's replies of 2 MiB values flow without a pause for each socket read.
# Bounded by the replies being read, which become Python bytes anyway.
STREAM_LIMIT_BYTES = 1 << 20
# A connection's hiredis buffer is kept between replies while its free space is at most this
# (hiredis frees it past 16 KiB): the buffer of a reply of 2 MiB is about 3 MiB. Costs at most
# this much memory per connection (the tier opens pool_size + 2 per server).
READER_KEEP_BYTES = 4 << 20


class TierConnectionUnavailable(RuntimeError):
    """This redis-py does not expose what ``use_tier_connections`` replaces."""


class Framed:
    """A value sent as ``header`` then ``body`` (a byte memoryview), without joining them.
    The body's buffer must stay unchanged until the command has been sent."""

    __slots__ = ("body", "header")

    def __init__(self, header: bytes, body: memoryview) -> None:
        self.header = header
        self.body = body

    def __len__(self) -> int:
        return len(self.header) + len(self.body)


# The transports that took a ``Framed`` body in the pipeline ``releasing_bodies`` wraps (the
# pipeline's tasks see the list of the task that started them, their contexts being copies).
_TAKEN: ContextVar[list[Any] | None] = ContextVar("kvtier_l3_taken", default=None)


class NodeFaults:
    """The connection faults the connections met within ``noting_node_faults``, each with
    its connection's node (``host:port``, a cluster node's name). ``deadline`` (the event
    loop's time), if any: when every wait of a connection within ends, a timeout of its
    node."""

    __slots__ = ("_nodes", "deadline")

    def __init__(self, deadline: float | None = None) -> None:
        # id(fault) -> (node, fault): the fault kept alive, so that its id stays its own.
        self._nodes: dict[int, tuple[str, BaseException]] = {}
        self.deadline = deadline

    def note(self, node: str, fault: BaseException) -> None:
        self._nodes[id(fault)] = (node, fault)

    def node_of(self, fault: BaseException) -> str | None:
        """The node whose connection raised ``fault`` (a reply of the pipeline), if noted."""
        found = self._nodes.get(id(fault))
        return found[0] if found is not None else None


# The faults of the pipeline ``noting_node_faults`` wraps (its tasks see the one of the task
# that started them, their contexts being copies).
_FAULTS: ContextVar[NodeFaults | None] = ContextVar("kvtier_l3_faults", default=None)
# ConnectionErrors that are the server's refusal of the client, not a fault of the connection.
_REFUSALS = (AuthenticationError, AuthorizationError)


def node_fault(fault: BaseException) -> bool:
    """Whether ``fault`` is a fault of a connection to one node (refused, reset, closed, or
    no answer in time): what ``noting_node_faults`` answers and notes, and what the tier
    takes as that master lost at once. Not a refused credential."""
    if isinstance(fault, RedisTimeoutError):
        return True
    return isinstance(fault, RedisConnectionError) and not isinstance(fault, _REFUSALS)


# The node (host, port) an ``ASKING`` held back is for: the next command its task packs goes
# with it, if that command is for the same node (see the module docstring).
_ASKING: ContextVar[tuple[str, int] | None] = ContextVar("kvtier_l3_asking", default=None)
_ASKING_NAMES = (b"ASKING", "ASKING")
# The packed ASKING, one object, so that a send can tell its command carries one.
_ASKING_PACKED = b"*1\r\n$6\r\nASKING\r\n"


@contextlib.contextmanager
def noting_node_faults(faults: NodeFaults | None) -> Iterator[None]:
    """Within: a connection fault of a send (refused, reset, closed) is answered by the
    reads of that command or pipeline instead of raised, and every connection fault met,
    of a send or a read, is noted in ``faults`` (see the module docstring); with None,
    every fault is raised, as outside."""
    token = _FAULTS.set(faults)
    try:
        yield
    finally:
        _FAULTS.reset(token)


@contextlib.contextmanager
def releasing_bodies() -> Iterator[None]:
    """Within: a pipeline whose ``Framed`` bodies are the caller's until it is left. Left by
    an exception, every transport a body was written to is aborted before the exception goes
    on, so that no byte of a body it still held is sent after the caller has its buffers back
    (see the module docstring). Left normally, every reply has come: the store has it all."""
    taken: list[Any] = []
    token = _TAKEN.set(taken)
    try:
        yield
    except BaseException:
        for transport in dict.fromkeys(taken):
            _abort(transport)
        raise
    finally:
        _TAKEN.reset(token)


def _abort(transport: Any) -> None:
    """Close ``transport`` at once, dropping what it has not sent."""
    # Shut at once: uvloop's abort closes the socket only on a later turn of the loop, and a
    # socket that became writable meanwhile took more of what it held. (The transport's
    # socket has no shutdown of its own; one of a dup of its fd shuts the connection all the
    # same.)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with (
            contextlib.suppress(OSError),
            socket.fromfd(sock.fileno(), sock.family, sock.type) as dup,
        ):
            dup.shutdown(socket.SHUT_WR)
    transport.abort()


class _TierConnection:
    """Connection mixin: packs a command holding a ``Framed`` argument itself (any other
    command is redis-py's), writes chunks without joining them, and reads with a larger stream
    buffer and a kept hiredis buffer."""

    encoder: Any
    _reader: Any
    _writer: Any
    host: str
    port: int
    socket_timeout: float | None
    socket_connect_timeout: float | None
    # The socket and connect timeouts the connection was made with, once a send has given
    # it less (``_give_time_left``).
    _own_timeouts: tuple[float | None, float | None] | None = None
    # An ASKING held back answers its read with OK; replies of ASKINGs sent before a
    # command, read and dropped before its own.
    _asking_held = False
    _asking_replies = 0
    # A connection fault of the last send or of a read after it, answered by the reads that
    # follow (within ``noting_node_faults``); a send within a send is redis-py's handshake
    # of the connection, whose faults it must see raised.
    _fault: BaseException | None = None
    _sending = False

    def pack_command(self, *args: Any) -> list[bytes | memoryview]:
        asking = _ASKING.get()
        if asking is not None:
            _ASKING.set(None)
        if len(args) == 1 and args[0] in _ASKING_NAMES:
            _ASKING.set((self.host, self.port))
            return []  # sends nothing (see send_packed_command)
        packed = self._pack(*args)
        if asking == (self.host, self.port):
            return [_ASKING_PACKED, *packed]
        return packed

    def pack_commands(self, commands: Iterable[Iterable[Any]]) -> list[bytes | memoryview]:
        # A pipeline never carries an ASKING (redis-py resends a redirected command alone).
        _ASKING.set(None)
        return super().pack_commands(commands)  # type: ignore[misc, no-any-return]

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        within = self._sending
        late = False
        if not within:
            self._fault = None
            late = not self._give_time_left(_FAULTS.get())
            reader = self._reader
            if reader is not None and (reader.at_eof() or reader.exception() is not None):
                # Closed by the server while it idled in the pool (its ``timeout``, CLIENT
                # KILL, a restart): connected afresh, as redis-py's own pool does for a
                # single server; a cluster node's hands it out as it is.
                await self.disconnect()
        self._sending = True
        try:
            if late:
                raise RedisTimeoutError(f"Timeout sending to {self.host}:{self.port}")
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except (RedisConnectionError, RedisTimeoutError) as e:
            # redis-py closed the connection: its transport, and any body it held, are gone.
            # Within the handshake (sends of its own before reads of its own) it is raised:
            # answered, its next send connected again, and its reads took that one's reply
            # for the first's, then waited for the op timeout; the send that connects
            # answers it.
            if within or not node_fault(e) or not self._noted(e):
                raise
            self._fault = e
            return
        finally:
            self._sending = within
        # Marked once sent: a fresh connection's handshake, sent and read in between, reads
        # its own replies.
        if type(command) is list:
            if not command:
                self._asking_held = True  # only an ASKING held back packs to nothing
            elif command[0] is _ASKING_PACKED:
                self._asking_replies += 1

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        if self._fault is not None:
            raise self._fault
        if self._asking_held:
            self._asking_held = False
            return b"OK"
        writer = self._writer
        # An error answering an ASKING (an ACL that denies it) is raised once the command's
        # own reply is read too: raised at once, it left that reply unread on a connection
        # going back to the pool, and each later call on it read the reply of the one before.
        refused: ResponseError | None = None
        try:
            while self._asking_replies:
                self._asking_replies -= 1
                try:
                    await super().read_response(*args, **kwargs)  # type: ignore[misc]
                except ResponseError as e:
                    refused = e
            if refused is None:
                return await super().read_response(*args, **kwargs)  # type: ignore[misc]
            with contextlib.suppress(ResponseError):
                await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except (RedisConnectionError, RedisTimeoutError) as e:
            if isinstance(e, RedisTimeoutError) and writer is not None:
                # redis-py closed the connection, gracefully: it would send what its
                # transport still holds (a body's last bytes) once the node reads again.
                _abort(writer.transport)
            if node_fault(e) and self._noted(e):
                self._fault = e  # this send's later replies are lost with the connection
            raise
        raise refused

    def _give_time_left(self, faults: NodeFaults | None) -> bool:
        """Before a send: the connection's socket and connect timeouts are its own, or, with
        ``faults.deadline``, at most the time left to it, so that the timers redis-py sets on
        each of its waits anyway (the connect and handshake, the send, each reply read after
        it) end a silent node's first wait by the deadline: a TimeoutError, the connection
        closed. Set once per send, not per reply (a pipeline reads dozens). False where the
        deadline has passed: the send is to send nothing (redis-py's send takes a timeout of
        0 s for none at all)."""
        deadline = None if faults is None else faults.deadline
        own = self._own_timeouts
        if own is None:
            if deadline is None:
                return True  # never shortened: its own already
            own = self._own_timeouts = (self.socket_timeout, self.socket_connect_timeout)
        if deadline is None:
            self.socket_timeout, self.socket_connect_timeout = own
            return True
        left_s = deadline - asyncio.get_running_loop().time()
        if left_s <= 0.0:
            return False
        self.socket_timeout = left_s if own[0] is None else min(own[0], left_s)
        self.socket_connect_timeout = left_s if own[1] is None else min(own[1], left_s)
        return True

    def _noted(self, fault: BaseException) -> bool:
        """Note ``fault`` as this connection's node's; False outside ``noting_node_faults``."""
        faults = _FAULTS.get()
        if faults is None:
            return False
        faults.note(f"{self.host}:{self.port}", fault)
        return True

    async def disconnect(self, *args: Any, **kwargs: Any) -> None:
        self._asking_held = False
        self._asking_replies = 0
        await super().disconnect(*args, **kwargs)  # type: ignore[misc]

    def _pack(self, *args: Any) -> list[bytes | memoryview]:
        if not any(type(a) is Framed for a in args):
            return super().pack_command(*args)  # type: ignore[misc, no-any-return]
        out: list[bytes | memoryview] = []
        head = b"*%d\r\n" % len(args)
        for arg in args:
            if type(arg) is Framed:
                # The body goes out as its own chunk: pack_commands passes memoryviews
                # through instead of joining them with their neighbours.
                out.append(head + b"$%d\r\n" % len(arg) + arg.header)
                out.append(arg.body)
                head = b"\r\n"
            else:
                data = self.encoder.encode(arg)
                head += b"$%d\r\n" % len(data) + bytes(data) + b"\r\n"
        out.append(head)
        return out

    async def _send_packed_command(self, command: Iterable[bytes | memoryview]) -> None:
        # redis-py sends through here whenever a socket timeout is set (the tier always sets
        # one); StreamWriter.writelines would join the chunks first (see the module docstring).
        writer = self._writer
        taken = _TAKEN.get()
        for chunk in command:
            if writer.transport.is_closing():
                break  # lost meanwhile: drain raises; more writes would only log warnings
            if taken is not None and type(chunk) is not bytes:
                taken.append(writer.transport)  # a body (see releasing_bodies)
            writer.write(chunk)
        try:
            await writer.drain()
        except BaseException:
            # Cut off (a timeout, a cancel): redis-py closes the connection, gracefully,
            # which would send the rest of a body once the node reads again.
            _abort(writer.transport)
            raise

    def _connection_arguments(self) -> Mapping[str, Any]:
        return {**super()._connection_arguments(), "limit": STREAM_LIMIT_BYTES}  # type: ignore[misc]

    def set_parser(self, parser_class: type) -> None:
        super().set_parser(_keeping_buffer(parser_class))  # type: ignore[misc]


class _KeepingBuffer(_AsyncHiredisParser):
    """hiredis, keeping its reply buffer between replies of a few MiB."""

    def on_connect(self, connection: Any) -> None:
        super().on_connect(connection)
        setmaxbuf = getattr(getattr(self, "_reader", None), "setmaxbuf", None)
        if setmaxbuf is not None:  # else an older hiredis: frees its buffer as before
            setmaxbuf(READER_KEEP_BYTES)


def _keeping_buffer(parser_class: type) -> type:
    """``parser_class``, or its buffer-keeping subclass if it is redis-py's hiredis parser (the
    pure-Python parsers keep no buffer of their own)."""
    if parser_class is _AsyncHiredisParser:
        return _KeepingBuffer
    return parser_class


_CLASSES: dict[type, type] = {}


def _tier_class(base: type) -> type:
    if not issubclass(base, Connection):
        raise TierConnectionUnavailable(f"unexpected connection class {base!r}")
    if issubclass(base, _TierConnection):
        return base
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(f"Tier{base.__name__}", (_TierConnection, base), {})
        _CLASSES[base] = cls
    return cls


def use_tier_connections(client: Any) -> None:
    """Make every connection ``client`` (a ``redis.asyncio.Redis`` or ``RedisCluster`` not
    yet used) opens a ``_TierConnection``."""
    if isinstance(client, RedisCluster):
        manager = getattr(client, "nodes_manager", None)
        kwargs = getattr(manager, "connection_kwargs", None)
        nodes = getattr(manager, "startup_nodes", None)
        if not isinstance(kwargs, dict) or not isinstance(nodes, dict):
            raise TierConnectionUnavailable("RedisCluster without nodes_manager.connection_kwargs")
        # Nodes found later are built from these kwargs; the startup nodes exist already.
        kwargs["connection_class"] = _tier_class(kwargs.get("connection_class", Connection))
        for node in nodes.values():
            node.connection_class = _tier_class(node.connection_class)
        return
    pool = getattr(client, "connection_pool", None)
    if pool is None or not hasattr(pool, "connection_class"):
        raise TierConnectionUnavailable("client without connection_pool.connection_class")
    pool.connection_class = _tier_class(pool.connection_class)
