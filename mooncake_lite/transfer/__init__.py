"""Binary framed transfer over asyncio streams (uvloop): store data plane and the P->D KV stream.

framing.py     the header struct, Frame, encode/decode, limits
connection.py  FrameConnection (BufferedProtocol, in-place receive) and FrameHandler callbacks
server.py      start_server with the cluster-token handshake
client.py      FrameClient: pipelined request/response with receive-into-caller-memory
kv_stream.py   the prefill -> decode KV stream's op codes and frame layouts
rdma.py        transport selection (RDMA detection; TCP fallback)
"""
