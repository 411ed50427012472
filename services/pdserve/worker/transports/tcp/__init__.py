"""``tcp``: two-sided push of KV over TCP, landing directly in the destination blocks.

Design choice — raw non-blocking sockets driven by the event loop, not asyncio streams or a
``BufferedProtocol``:

- Zero copy on both sides needs *scatter/gather*: a layer's blocks are generally not contiguous
  (any block ids), and the payload must land in them without a bounce buffer. ``recvmsg_into``
  scatters one read over up to 1024 block views and ``sendmsg`` gathers the source blocks into
  one write; neither is reachable through a transport. (A ``BufferedProtocol`` gets one buffer
  per readiness event, so a layer of small non-contiguous blocks costs an event-loop round per
  block; ``StreamReader`` copies everything through its own buffer.)
- Reading a frame is a sequential coroutine: header (exact size, never past it), block ids,
  *validate*, then payload. So the decision to write is taken before the first payload byte is
  read, and re-taken (``LayerAdmission.still_writable``) before every later read of the frame: a
  ``cancel`` or a block release on the loop between two reads diverts the rest to a scratch
  buffer. Reads loop while data is there, without going back to the selector; while a long
  payload is still arriving, the socket's low-water mark (SO_RCVLOWAT) makes the loop wake for
  a good part of it rather than for every segment.
- Consecutive block ids are one contiguous run of memory and go as one buffer.

What a ticket costs beyond its bytes is kept small, because at small prompts it is most of the
handoff:

- One connection per (sender process, destination), kept open and shared by every ticket sent
  there (``_SenderConnection``; closed after ``idle_close_s`` unused, or when it breaks — the
  next ticket connects anew). Frames of different tickets never interleave on the wire: a
  frame is written whole, and one still being written when its sender is cancelled is finished
  by a writer task before anything else goes out. Replies name their ticket; one reader per
  connection routes them. A refusal fails its ticket only; a malformed frame makes the receiver
  close the connection, which fails the tickets on it (and only those).
- No round trip before the first layer: HELLO goes with flag NO_ACK and the layers follow at
  once. Every LAYER frame is validated on its own anyway; if the receiver refuses the HELLO it
  answers ERROR and drops the ticket's later frames on that connection unanswered. The sender
  learns of it at its next ``offer_layer`` or at ``finish`` (whose DONE is still answered).
- Layers that are ready together (the agent offers every layer it finds finished) go as one
  LAYERS frame per run of consecutive layers: one header, one admission, one scatter read.
- Per-ticket work on the receiver is done once, not per frame: a connection decodes a block-id
  list once for all the frames that repeat it, and the ownership check of an unchanged,
  read-only id list is reused until a block is released anywhere (the owner table's epoch).

``socket_buffer_nbytes`` = 0 leaves kernel autotuning on (setting SO_SNDBUF/SO_RCVBUF turns it
off and is capped by net.core.[rw]mem_max).

TLS (``TcpTransportSettings.tls``, off by default: the data path runs in clear inside a trusted
fabric, as RDMA does). ``ssl.SSLSocket`` has no ``sendmsg``/``recvmsg_into``, so a TLS connection
drives an ``ssl.SSLObject`` through two memory BIOs over the same non-blocking socket
(``_TlsSocketIo``): ciphertext is read from the socket into the engine and the plaintext is
decrypted straight into the destination block views, so the receive side still needs no bounce
buffer for the payload (decryption is the one copy); the send side encrypts each block view in
chunks. Both ends present certificates of the cluster CA (mutual TLS), the sender checks the
receiver's host name, and each side requires the other's SPIFFE identity to be a worker
(``pdserve.common.certs``). Frames are validated exactly as in clear. A pooled connection keeps
the certificate it was opened with: once the files are renewed, tickets go on new connections
and the old ones idle out. With TLS 1.3 the receiver judges the sender's certificate after the
sender's handshake has completed, so a refused sender finds out at its first reply (``finish``
at the latest). ``bench/tls_cost.py`` measures what TLS costs in bandwidth.
"""
