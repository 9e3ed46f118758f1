"""TCP block transport: client (``TcpTransport``) and server (``TcpBlockServer``).

Protocol: ``framing`` (length-framed messages, self-delimiting ``blockfmt`` blocks with an
xxh3_64 checksum each).  Why raw sockets and not ``asyncio`` streams: ``StreamWriter.write`` (3.11)
copies whatever the kernel does not take at once into its own buffer, and ``StreamReader`` hands
out new ``bytes``; here sends are ``sendmsg`` of memoryviews of the tensors' own storage (header and
payload in one vectored call) and receives are ``recv_into`` the destination tensor, in chunks of
``recv_chunk`` bytes that are hashed while still in cache.  Backpressure is the kernel's: a send
waits for writability before continuing.  Every exchange runs under a timeout; a connection that
failed or timed out is closed, never reused.

Versions (``framing``): blocks travel with their ``Block.version``.  The server exports through its
``export`` hook and hands pushed blocks, versions attached, to its ``accept`` hook, which decides
what a copy may overwrite (``base``: the same hooks as ``DistTransport.serve_one``; by default
``plain_export`` / ``plain_accept``, unversioned).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Sequence

from ..blockfmt import Block
from ..errors import (
    AgentError,
    PeerGone,
    ProtocolError,
    RemoteError,
    TransferTimeout,
)
from .base import plain_accept, plain_export
from .framing import (
    FLAG_PREFIX,
    Frame,
    Op,
    error_message,
    fetch_message,
    pack_frame,
    pack_versions,
    unpack_keys,
    unpack_versions,
)
from .sockio import (
    UNIX,
    Alloc,
    BlockReceiver,
    Peer,
    SocketStream,
    default_alloc,
    host_item,
    parse_peer,
    send_blocks,
    tune,
)

log = logging.getLogger(__name__)


class TcpTransport:
    """Client side: ``fetch`` blocks from / ``push`` blocks to a peer's ``TcpBlockServer``."""

    def __init__(
        self,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        verify: bool = True,
        alloc: Alloc = default_alloc,
        sock_buf: int | None = None,
        max_idle: int = 4,
        recv_chunk: int = 256 << 10,
    ) -> None:
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.verify = verify
        self.alloc = alloc
        self.sock_buf = sock_buf
        self.max_idle = max_idle
        self.recv_chunk = recv_chunk
        self._idle: dict[tuple[str, int], list[SocketStream]] = {}

    async def fetch(self, peer: Peer, keys: Sequence[int], *, prefix: bool = False) -> list[Block]:
        """Blocks the peer holds among ``keys`` in request order (``prefix``: up to the first miss)."""

        async def run(stream: SocketStream) -> list[Block]:
            await stream.sendv([fetch_message(keys, prefix=prefix)])
            receiver = BlockReceiver(self.alloc, verify=self.verify)
            blocks: list[Block] = []
            while True:
                frame = await self._reply(stream)
                if frame.op is Op.ACK:
                    if frame.count != len(blocks):
                        raise ProtocolError(
                            f"peer announced {frame.count} blocks, sent {len(blocks)}"
                        )
                    bad = receiver.mismatches()
                    if bad:
                        raise bad[0]
                    return blocks
                if frame.op is not Op.BLOCKS:
                    raise ProtocolError(f"unexpected {frame.op.name} in a fetch reply")
                versions = await _recv_versions(stream, frame)
                for version in versions:
                    blocks.append((await receiver.recv(stream))._replace(version=version))

        return await self._exchange(peer, run)

    async def push(self, peer: Peer, blocks: Sequence[Block]) -> int:
        """Send blocks for the peer to store; returns how many it did not already hold."""

        async def run(stream: SocketStream) -> int:
            items = (host_item(b) for b in blocks)  # hashed batch by batch, as they are sent
            body = pack_versions([b.version for b in blocks])
            await send_blocks(stream, pack_frame(Op.PUSH, len(blocks), len(body)) + body, items)
            frame = await self._reply(stream)
            if frame.op is not Op.ACK:
                raise ProtocolError(f"unexpected {frame.op.name} in a push reply")
            return frame.count

        return await self._exchange(peer, run)

    async def close(self) -> None:
        for streams in self._idle.values():
            for stream in streams:
                stream.close()
        self._idle.clear()

    async def _reply(self, stream: SocketStream) -> Frame:
        frame = await stream.recv_frame()
        if frame is None:
            raise PeerGone("peer closed the connection")
        if frame.op is Op.ERROR:
            raise RemoteError((await stream.recv_exact(frame.body_len)).decode(errors="replace"))
        return frame

    async def _connect(self, addr: tuple[str, int | str]) -> SocketStream:
        loop = asyncio.get_running_loop()
        if addr[0] == UNIX:
            sock, target = socket.socket(socket.AF_UNIX), addr[1]
        else:
            sock, target = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET), addr
        tune(sock, self.sock_buf)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, target), self.connect_timeout)
        except asyncio.TimeoutError as exc:
            sock.close()
            raise TransferTimeout(f"connecting to {addr[0]}:{addr[1]} timed out") from exc
        except OSError as exc:
            sock.close()
            raise PeerGone(f"cannot connect to {addr[0]}:{addr[1]}: {exc}") from exc
        return SocketStream(sock, recv_chunk=self.recv_chunk)

    async def _exchange(self, peer: Peer, run):
        """Run one exchange on a pooled connection; a pooled connection the peer has meanwhile
        closed gets one retry on a fresh one (both exchanges are idempotent)."""
        addr = parse_peer(peer)
        idle = self._idle.setdefault(addr, [])
        while idle:
            try:
                return await self._run_on(idle.pop(), addr, run)
            except PeerGone:
                continue  # stale: fall through to a fresh connection
        return await self._run_on(await self._connect(addr), addr, run)

    async def _run_on(self, stream: SocketStream, addr: tuple[str, int], run):
        try:
            result = await asyncio.wait_for(run(stream), self.timeout)
        except asyncio.TimeoutError as exc:
            stream.close()
            raise TransferTimeout(f"transfer with {addr[0]}:{addr[1]} timed out") from exc
        except BaseException:
            stream.close()
            raise
        idle = self._idle.setdefault(addr, [])
        if len(idle) < self.max_idle:
            idle.append(stream)
        else:
            stream.close()
        return result


async def _recv_versions(stream: SocketStream, frame: Frame) -> list:
    body = await stream.recv_exact(frame.body_len) if frame.body_len else b""
    return unpack_versions(body, frame.count)


class TcpBlockServer:
    """Serves a store's blocks to peers (FETCH) and stores the blocks they push (PUSH)."""

    def __init__(
        self,
        store,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout: float = 30.0,
        verify: bool = True,
        chunk_bytes: int = 32 << 20,
        sock_buf: int | None = None,
        recv_chunk: int = 256 << 10,
        export=None,
        accept=None,
        unix_path: str | None = None,
    ) -> None:
        self.store = store
        self.unix_path = unix_path  # also listen here (AF_UNIX): the engine-local connector's way in
        self._unix: socket.socket | None = None
        self.export = export or plain_export(store)
        self.accept = accept or plain_accept(store)
        self.recv_chunk = recv_chunk
        self.host, self._port = host, port
        self.timeout = timeout
        self.verify = verify
        self.chunk_bytes = chunk_bytes
        self.sock_buf = sock_buf
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("server not started")
        return self._sock.getsockname()[1]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> TcpBlockServer:
        self._sock = socket.create_server((self.host, self._port), backlog=128)
        self._sock.setblocking(False)
        self._spawn(self._accept_loop(self._sock))
        if self.unix_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)  # a stale socket file from an earlier run
            self._unix = socket.socket(socket.AF_UNIX)
            self._unix.bind(self.unix_path)
            self._unix.listen(128)
            self._unix.setblocking(False)
            self._spawn(self._accept_loop(self._unix))
        return self

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._unix is not None:
            self._unix.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> TcpBlockServer:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            tune(conn, self.sock_buf)
            self._spawn(self._serve(SocketStream(conn, recv_chunk=self.recv_chunk)))

    async def _serve(self, stream: SocketStream) -> None:
        try:
            while (frame := await stream.recv_frame()) is not None:
                await asyncio.wait_for(self._handle(stream, frame), self.timeout)
        except (AgentError, asyncio.TimeoutError) as exc:
            log.warning("block server: closing connection: %r", exc)
        except Exception:
            log.exception("block server: unexpected error; closing connection")
        finally:
            stream.close()

    async def _handle(self, stream: SocketStream, frame: Frame) -> None:
        if frame.op is Op.FETCH:
            keys = unpack_keys(await stream.recv_exact(frame.body_len), frame.count)
            await self._serve_fetch(stream, keys, bool(frame.flags & FLAG_PREFIX))
        elif frame.op is Op.PUSH:
            await self._accept_push(stream, await _recv_versions(stream, frame))
        else:
            await stream.sendv([error_message(f"unexpected {frame.op.name}")])
            raise ProtocolError(f"unexpected {frame.op.name} from a client")

    def _export_chunk(self, keys: Sequence[int], start: int, prefix: bool):
        items, size, i = [], 0, start
        while i < len(keys) and size < self.chunk_bytes:
            item = self.export(keys[i])
            i += 1
            if item is None:
                if prefix:
                    return items, len(keys)
                continue
            items.append(item)
            size += item[0].nbytes
        return items, i

    async def _serve_fetch(self, stream: SocketStream, keys: Sequence[int], prefix: bool) -> None:
        """Send the blocks chunk by chunk; the next chunk is exported (a thread: it may read the
        disk tier) while the current one is being sent, so the socket never waits for it."""

        def export(start: int):
            return asyncio.ensure_future(
                asyncio.to_thread(self._export_chunk, keys, start, prefix)
            )

        total, ahead = 0, export(0) if keys else None
        try:
            while ahead is not None:
                items, i = await ahead
                ahead = export(i) if i < len(keys) else None
                if items:
                    body = pack_versions([v for _, _, v in items])
                    frame = pack_frame(Op.BLOCKS, len(items), len(body)) + body
                    await send_blocks(stream, frame, ((h, t) for h, t, _ in items))
                    total += len(items)
        finally:
            if ahead is not None:
                ahead.cancel()
        await stream.sendv([pack_frame(Op.ACK, total)])

    async def _accept_push(self, stream: SocketStream, versions: list) -> None:
        """Receive and store chunk by chunk; a chunk is stored (a thread: it may demote to disk)
        while the next one is received, one chunk in the store at a time."""
        receiver = BlockReceiver(self.store.landing, verify=self.verify)
        stored, pending, size, bad, count = 0, [], 0, [], len(versions)
        storing: asyncio.Future | None = None
        try:
            for i, version in enumerate(versions):
                block = await receiver.recv(stream)  # a bad block still keeps the stream in sync
                pending.append(block._replace(version=version))
                size += block.tensor.nbytes
                if size >= self.chunk_bytes or i == count - 1:
                    bad += receiver.mismatches()
                    rejected = {e.key for e in bad}
                    keep = [b for b in pending if b.key not in rejected]
                    stored += await storing if storing is not None else 0
                    storing = asyncio.ensure_future(asyncio.to_thread(self.accept, keep))
                    pending, size = [], 0
            stored += await storing if storing is not None else 0
            storing = None
        finally:
            if storing is not None:
                storing.cancel()
        if bad:
            await stream.sendv([error_message(str(bad[0]))])
        else:
            await stream.sendv([pack_frame(Op.ACK, stored)])
