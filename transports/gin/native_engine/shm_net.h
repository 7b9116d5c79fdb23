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
  void land(char* dst, const char* src, uint64_t nbytes, bool bulk) const {
#ifdef COMMREF_HAVE_STREAM
    if (streams(nbytes, bulk, nbytes)) {
      streamBytes(dst, src, nbytes);
      return;
    }
#endif
    landLines(dst, src, nbytes);
  }

  // A signal of `value` at the peer whose connection window is mapped at `peer`: index
  // `signal` (its signal slot) or, `va`, the word at window offset `signal`. Release:
  // after the data landed before it (its streamed stores fenced first).
  void signal(char* peer, bool va, uint64_t signal, uint64_t value) {
    settle();
    __atomic_fetch_add(reinterpret_cast<uint64_t*>(peer + (va ? signal : signalsOff_ + 8 * signal)), value,
                       __ATOMIC_RELEASE);
  }

  // A packet of the unordered wire (a segment, or a signal) at the peer whose window is
  // mapped at `peer`. A put's segments need no order among themselves, only before what
  // publishes them: a streamed segment is not fenced, the next signal or settle() fences.
  void deliver(const Packet& k, char* peer) {
    if (k.isSignal) {
      signal(peer, k.va, k.signal, k.value);
      return;
    }
#ifdef COMMREF_HAVE_STREAM
    if (streams(k.nbytes, k.bulk, k.whole)) {
      streamBytesUnfenced(k.dst, k.data(), k.nbytes, k.ahead, k.aheadBytes);
      unfenced_ = true;
      return;
    }
#endif
    landLines(k.dst, k.data(), k.nbytes, k.ahead, k.aheadBytes);
  }

  // Fences what this taker streamed and did not fence yet; the taker calls it before it
  // lets the queue go (the next taker's fences do not order this one's stores).
  void settle() {
#ifdef COMMREF_HAVE_STREAM
    if (unfenced_) _mm_sfence();
#endif
    unfenced_ = false;
  }

  // A get: the peer's bytes copied here before the descriptor is done.
  static void get(char* dst, const char* from, uint64_t nbytes) { std::memcpy(dst, from, nbytes); }

 private:
  // Whether `nbytes` of a put of `whole` bytes stream: bulk, by the put's size (the
  // unordered wire lands a put in segments).
  bool streams(uint64_t nbytes, bool bulk, uint64_t whole) const {
    return bulk && streamMinBytes_ && (whole > nbytes ? whole : nbytes) >= streamMinBytes_;
  }

  const uint64_t streamMinBytes_, signalsOff_;
  bool unfenced_ = false;  // streamed stores not fenced yet (deliver)
};

}  // namespace
