// The SHM network: every GIN peer's window is mapped in this process
// (window.peer_addresses), so the engine's taker lands a put's bytes and its signal in
// the peer's window itself and reads a get's source there; everything has landed when
// the descriptor is done (a flush has nothing left to wait for).
#pragma once

#include "commref/land.h"
#include "core.h"
#include "unordered.h"

namespace {

class ShmNet {
 public:
  explicit ShmNet(const CommrefGinEngineConfig& c) : streamMinBytes_(c.streamMinBytes), signalsOff_(c.signalsOff) {}

  // A put's bytes into the peer's window. Bulk data (kGinBulk: read only after a
  // signal) from streamMinBytes goes past this core's cache with non-temporal stores,
  // fenced (streamBytes), so the peer's core reads it from memory instead of fetching
  // each line from this one (on a host whose cores do not share a cache that is several
  // times faster: docs/performance.md, "Two placements"). Anything else line by line
  // (commref/land.h: in order, for kernels that poll LL lines there).
  // `whole`: the bytes of the put these are a segment of (the unordered wire lands a put
  // in segments; a bulk put streams by its size, not its segments').
  void land(char* dst, const char* src, uint64_t nbytes, bool bulk, uint64_t whole = 0) const {
#ifdef COMMREF_HAVE_STREAM
    if (bulk && streamMinBytes_ && (whole > nbytes ? whole : nbytes) >= streamMinBytes_) {
      streamBytes(dst, src, nbytes);
      return;
    }
#endif
    (void)bulk;
    (void)whole;
    landLines(dst, src, nbytes);
  }

  // A signal of `value` at the peer whose connection window is mapped at `peer`: index
  // `signal` (its signal slot) or, `va`, the word at window offset `signal`. Release:
  // after the data landed before it.
  void signal(char* peer, bool va, uint64_t signal, uint64_t value) const {
    __atomic_fetch_add(reinterpret_cast<uint64_t*>(peer + (va ? signal : signalsOff_ + 8 * signal)), value,
                       __ATOMIC_RELEASE);
  }

  // A packet of the unordered wire (a segment, or a signal) at the peer whose window is mapped at `peer`.
  void deliver(const Packet& k, char* peer) const {
    if (k.isSignal)
      signal(peer, k.va, k.signal, k.value);
    else
      land(k.dst, k.data(), k.nbytes, k.bulk, k.whole);
  }

  // A get: the peer's bytes copied here before the descriptor is done.
  static void get(char* dst, const char* from, uint64_t nbytes) { std::memcpy(dst, from, nbytes); }

 private:
  const uint64_t streamMinBytes_, signalsOff_;
};

}  // namespace
