// What the Thrift API fuzzers share (coordinator/server/fuzz/public_api_fuzz.cc,
// worker/service/fuzz/worker_api_fuzz.cc): an input is a connection's bytes,
// cut into frames and served as the servers serve them; seeds are calls made
// by the generated clients.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

#include <thrift/TProcessor.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include "transport/thrift_util.h"

namespace penumbra::transport::fuzz {

// Splits `data` into frames as the servers' framed transport reads them (a
// 4-byte big-endian size, at most max_frame_bytes, then the message) and runs
// each frame's message through `processor` with the servers' protocol
// (CheckedBinaryProtocol) and limits, until the bytes end or a frame or
// message is malformed (a server then closes the connection). Each frame is
// read from a memory buffer of its own (what the framed transport's
// per-frame buffer holds; it also spares Thrift's inline read path its
// null-buffer pointer arithmetic, undefined behaviour the sanitizer reports
// inside Thrift's header).
inline void RunFrames(apache::thrift::TProcessor& processor, const uint8_t* data, size_t size,
                      const ThriftLimits& limits) {
  using apache::thrift::transport::TMemoryBuffer;
  auto config = MakeConfiguration(limits);
  auto out_mem = std::make_shared<TMemoryBuffer>(config);
  auto out = std::make_shared<apache::thrift::protocol::TBinaryProtocol>(
      std::make_shared<apache::thrift::transport::TFramedTransport>(out_mem, config));
  size_t at = 0;
  for (int calls = 0; calls < 64 && size - at >= 4; ++calls) {
    const uint32_t frame = (uint32_t{data[at]} << 24) | (uint32_t{data[at + 1]} << 16) | (uint32_t{data[at + 2]} << 8) |
                           uint32_t{data[at + 3]};
    at += 4;
    if (frame > static_cast<uint32_t>(limits.max_frame_bytes) || frame > size - at) break;
    auto in_mem =
        std::make_shared<TMemoryBuffer>(const_cast<uint8_t*>(data + at), frame, TMemoryBuffer::OBSERVE, config);
    at += frame;
    auto in = std::make_shared<CheckedBinaryProtocol>(in_mem, limits.max_string_bytes, limits.max_container_elements,
                                                      true, true);
    try {
      if (!processor.process(in, out, nullptr)) break;
    } catch (const apache::thrift::TException&) {
      break;
    }
    out_mem->resetBuffer();
  }
}

// Writes to dir/name the framed bytes of the calls `send` makes with a
// generated client `Client` (a seed: a connection's valid requests).
template <typename Client>
void WriteSeed(const std::string& dir, const std::string& name, const std::function<void(Client&)>& send) {
  auto mem = std::make_shared<apache::thrift::transport::TMemoryBuffer>();
  auto proto = std::make_shared<apache::thrift::protocol::TBinaryProtocol>(
      std::make_shared<apache::thrift::transport::TFramedTransport>(mem));
  Client client(proto);
  send(client);
  std::ofstream(dir + "/" + name, std::ios::binary) << mem->getBufferAsString();
}

}  // namespace penumbra::transport::fuzz
