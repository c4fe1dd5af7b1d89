// The ids the coordinator's durable stores hand out (jobs "job-…", files
// "file-…"): a prefix and 16 hex digits of Mix(seq ^ salt), where seq is the
// store's sequence number (never reused) and salt a random number kept in
// the store's own record. Mix (murmur3's finalizer) is a bijection, so
// distinct sequence numbers give distinct ids, an id gives back its
// sequence number (stores page by id), and ids do not reveal how many
// things a store holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace penumbra::jobs {

inline constexpr size_t kStoreIdHexDigits = 16;

std::string MakeStoreId(std::string_view prefix, uint64_t seq, uint64_t salt);
// The sequence number of a well-formed id of `prefix`; false when `id` is
// not one.
bool StoreIdSeq(std::string_view prefix, std::string_view id, uint64_t salt, uint64_t* seq);

// A caller's name (a custom_id, a file name) for an error message: quoted,
// long ones cut short.
std::string Quoted(std::string_view name);
// Seconds since the epoch (the stores' default clock).
int64_t WallClockSeconds();

}  // namespace penumbra::jobs
