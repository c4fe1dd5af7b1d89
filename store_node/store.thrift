// The value-store node's messages (penumbra-store; store_node/store_node.h),
// carried over the UCX plane (transport/ucx_rpc.h) rather than a Thrift
// transport: a request's method is the UCX message's, its body one of
// these structs in Thrift's binary protocol. A READV's reply is the bytes
// themselves (no struct around them: the data path). Documents go up in
// parts and come back through readers, so none needs one message of its
// size (a 124928-token ShadowKV document is 10.6 GB).
//
// Readers and uploads are named by handles: 128 random bits as 32 hex
// digits, bound on the node to the client that made them (the UCX plane's
// client id, proved with the cluster secret): another client's handle, or a
// guessed one, is NotFound.

namespace cpp penumbra.rpc.store
namespace py penumbra.rpc.store

enum StoreMethod {
  PUT_BEGIN = 1,   // key, cache_namespace, tokens, sizes, block_bytes -> upload (sizes checked first)
  PUT_PART = 2,    // upload, blob, offset, data (parts of at most 64 MiB, within the blob)
  PUT_COMMIT = 3,  // upload: stored once every byte of every blob came
  LAYOUT = 4,      // key -> layout
  INFO = 5,        // key -> info
  ERASE = 6,       // key
  OPEN = 7,        // key -> reader, layout: the segment stays attached while the reader lives
  CLOSE = 9,       // reader
  READV = 10,      // reader, blob, offsets, lengths -> the ranges' bytes, concatenated (raw; at most 64 MiB)
  // (8 was READ, one range: READV with one range does it)
}

struct StoreKey {
  1: i64 hi,
  2: i64 lo,
}

struct StoreBlobLayout {
  1: string name,
  2: i64 size,
  3: i64 block_bytes,
  4: i32 blocks,
}

struct StoreInfo {
  1: string cache_namespace,
  2: i64 tokens,
  3: i64 bytes,
  4: bool pinned,
}

struct StoreRequest {
  1: StoreKey key,
  2: string cache_namespace,
  3: i64 tokens,
  4: map<string, i64> sizes,
  5: map<string, i64> block_bytes,
  // (6 and 7 were i64 upload and reader ids, sequential: now handles, 14 and 15)
  8: string blob,
  9: i64 offset,
  11: binary data,
  12: list<i64> offsets,
  13: list<i64> lengths,
  14: string upload,
  15: string reader,
}

struct StoreReply {
  1: StoreInfo info,
  2: list<StoreBlobLayout> layout,
  // (3 and 4 were i64 reader and upload ids: now handles, 5 and 6)
  5: string reader,
  6: string upload,
}
