// The native engine's wire: ORDERED delivery per (peer, ctx) link, its trace, and the
// wire model.
//
// Ordered: one taker takes every descriptor in slot order (engine.cpp), so each (peer,
// ctx) link is FIFO and a put's data, counter and signal happen in that order before
// the next descriptor; Links numbers what is posted on each link as the Python
// scheduler does (its link()), for the trace. Every context of a peer lands in slot
// order too, a legal refinement of per-context FIFO, unless independent contexts are on
// (contexts.h). The unordered wire is unordered.h's; the lossy wire is the Python
// proxy's (faults.py).
//
// Trace (when on): per descriptor, the events it made happen, appended in the order they
// happen to one bounded buffer (CommrefGinTraceRecord, decoded by native.py into the
// Python scheduler's ordered-wire tuples): post (seq, offset, nbytes, the signal as
// applied), data, counter, signal (the order they happen here; the Python proxy bumps
// the counter after the signal); flush (on every link of the context posted or rung
// so far), doorbell (its number on the link, from 1), get. Past traceCapacity records
// held, nothing more is recorded and the loss is counted (takeTrace's caller refuses
// the trace). Off, the fast path pays one relaxed load per descriptor; the link table
// (sequence numbers, doorbell counts) is kept either way, behind a one-entry cache.
//
// Wire model (wireBytesPerS or wireLatencyNs set; GinOptions.wire_rate, wire_latency):
// this rank's wire is one link that sends the descriptors in queue order. Descriptor i,
// first seen published at t_i, starts when the wire is free, s_i = max(t_i, f_(i-1)),
// is sent by f_i = s_i + bytes_i / rate (bytes_i: a put's or a get's bytes, 8 for a
// putValue, 0 otherwise), and takes effect at d_i = f_i + latency. The d_i never fall,
// so executing descriptors in queue order, each once the clock reaches its d_i, is the
// model exactly; a flush therefore returns once everything before it has landed. While
// the head is not due the engine polls (it never sleeps past d_i).
#pragma once

#include <unordered_map>

#include "core.h"

// One event on link (peer, ctx); native.py's TRACE_DTYPE mirrors it.
enum : uint32_t {
  kTracePost = 1,
  kTraceFlush,
  kTraceDoorbell,
  kTraceData,
  kTraceSignal,
  kTraceCounter,
  kTraceGet,
  kTraceSeg,      // unordered: a = segment, b = copy
  kTraceHold,     // unordered: a = the doorbell that releases it at the latest
  kTraceRelease,  // unordered: a = why (UnorderedWire::kRelease*)
};
enum : uint32_t { kTraceHasSignal = 1, kTraceStrong = 2, kTraceVa = 4 };  // a post's flags
struct CommrefGinTraceRecord {
  int32_t peer, ctx;
  uint32_t kind, flags;
  uint64_t seq;  // post, data, signal, counter: the put's seq on its link (from 0); doorbell: its number (from 1)
  uint64_t a, b, c, d;  // post: offset, nbytes, signal id or VA offset, signal value; counter: a = index;
                        // get: a = src, b = dst, c = bytes; seg, hold, release: above
};

namespace {

// The links (peer, ctx) and the trace of what happened on them. The links are the
// taker's only; the trace buffer is shared with the host's reads (its mutex).
class Delivery {
 public:
  explicit Delivery(const CommrefGinEngineConfig& c) : traceCapacity_(c.traceCapacity) {
    tracing_.store(c.trace != 0, std::memory_order_relaxed);
  }

  struct Link {
    uint64_t seq = 0, doorbells = 0;  // operations posted, doorbells rung (the trace's numbers)
  };

  // The link (peer, ctx), created on first use (as the Python scheduler's link()); the
  // last one is cached (unordered_map nodes do not move).
  Link& link(int32_t peer, int32_t ctx) {
    const uint64_t key = LinkMap<Link>::key(peer, ctx);
    if (lastLink_ == nullptr || key != lastKey_) {
      lastLink_ = &links_[key];
      lastKey_ = key;
    }
    return *lastLink_;
  }

  bool tracing() const { return tracing_.load(std::memory_order_relaxed); }

  void record(const CommrefGinTraceRecord* r, size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    if (traceLost_ || trace_.size() + n > traceCapacity_) {  // refused from the first loss on: no holes
      traceLost_ += n;
      return;
    }
    trace_.insert(trace_.end(), r, r + n);
  }

  // A flush of `ctx`: recorded on every link of the context so far.
  void traceFlush(int32_t ctx) {
    std::vector<CommrefGinTraceRecord> r;
    for (const auto& kv : links_)
      if ((int32_t)(uint32_t)kv.first == ctx)
        r.push_back({(int32_t)(kv.first >> 32), ctx, kTraceFlush, 0, 0, 0, 0, 0, 0});
    if (!r.empty()) record(r.data(), r.size());
  }

  // What a put (putValue, signal) made happen, in its order: posted, its data, its
  // counter (when bumped before the descriptor was done), its signal.
  // `early`: the signal was applied before the data (a planted bug, core.h's kPlantSignalFirst).
  void tracePut(const GinDescriptor& d, uint64_t seq, uint64_t nbytes, uint64_t value, bool counted, bool strongAlways,
                bool early = false) {
    const bool hasSignal = d.flags & kGinHasSignal;
    CommrefGinTraceRecord r[4];
    size_t n = 0;
    r[n++] = postRecord(d, seq, nbytes, value, strongAlways);
    if (hasSignal && early) r[n++] = {d.peer, d.ctx, kTraceSignal, 0, seq, 0, 0, 0, 0};
    if (nbytes) r[n++] = {d.peer, d.ctx, kTraceData, 0, seq, 0, 0, 0, 0};
    if (counted) r[n++] = {d.peer, d.ctx, kTraceCounter, 0, seq, d.counter, 0, 0, 0};
    if (hasSignal && !early) r[n++] = {d.peer, d.ctx, kTraceSignal, 0, seq, 0, 0, 0, 0};
    record(r, n);
  }

  // A put posted and not landed yet (the unordered wire records its landings as they happen).
  void tracePost(const GinDescriptor& d, uint64_t seq, uint64_t nbytes, uint64_t value, bool strongAlways) {
    const CommrefGinTraceRecord r = postRecord(d, seq, nbytes, value, strongAlways);
    record(&r, 1);
  }

  static CommrefGinTraceRecord postRecord(const GinDescriptor& d, uint64_t seq, uint64_t nbytes, uint64_t value,
                                          bool strongAlways) {
    const bool hasSignal = d.flags & kGinHasSignal, va = d.flags & kGinVaSignal;
    uint32_t flags = 0;
    if (hasSignal) {
      flags = kTraceHasSignal | (va ? kTraceVa : 0) | ((d.flags & kGinStrongSignal) || strongAlways ? kTraceStrong : 0);
    }
    return {d.peer, d.ctx, kTracePost, flags, seq, d.dstOffset, nbytes, hasSignal ? d.signal : 0, value};
  }

  void setTrace(bool on) {
    std::lock_guard<std::mutex> g(mu_);
    trace_.clear();
    traceLost_ = 0;
    tracing_.store(on, std::memory_order_release);
  }

  size_t takeTrace(CommrefGinTraceRecord* out, size_t max, uint64_t* lost) {
    std::lock_guard<std::mutex> g(mu_);
    *lost = traceLost_;
    const size_t n = trace_.size() < max ? trace_.size() : max;
    if (n) {
      std::memcpy(out, trace_.data(), n * sizeof(CommrefGinTraceRecord));
      trace_.erase(trace_.begin(), trace_.begin() + n);
    }
    return n;
  }

 private:
  std::unordered_map<uint64_t, Link> links_;  // (peer, ctx) -> its link (taker only)
  uint64_t lastKey_ = 0;
  Link* lastLink_ = nullptr;
  std::atomic<bool> tracing_{false};
  std::mutex mu_;  // trace_, traceLost_
  std::vector<CommrefGinTraceRecord> trace_;
  const uint64_t traceCapacity_;
  uint64_t traceLost_ = 0;  // records not kept since the trace was last set
};

// The wire model (the taker's, but for headDue(), which the engine thread reads): each
// descriptor's landing time, stamped when first seen published.
class WireModel {
 public:
  WireModel(const CommrefGinEngineConfig& c, const GinDescriptor* ring)
      : modeled(c.wireBytesPerS > 0 || c.wireLatencyNs > 0), cfg_(c), ring_(ring), landsAt_(modeled ? c.capacity : 0) {}

  const bool modeled;  // whether the model is on

  // Stamps every descriptor published since the last call (from stamped_ up to `next` +
  // capacity, published(slot) says which) with its landing time, then whether `slot`
  // (the head, published) is due.
  template <typename Published>
  bool due(uint64_t slot, uint64_t next, Published published) {
    const uint64_t now = nowNs();
    for (; stamped_ < next + cfg_.capacity && published(stamped_); stamped_++) {
      const GinDescriptor& d = ring_[stamped_ % cfg_.capacity];
      const uint64_t bytes = d.op == kGinPut || d.op == kGinGet ? d.bytes : d.op == kGinPutValue ? 8 : 0;
      const uint64_t start = now > wireFreeNs_ ? now : wireFreeNs_;
      wireFreeNs_ = start + (cfg_.wireBytesPerS > 0 ? (uint64_t)((double)bytes * 1e9 / cfg_.wireBytesPerS) : 0);
      landsAt_[stamped_ % cfg_.capacity] = wireFreeNs_ + cfg_.wireLatencyNs;
    }
    headDueNs_.store(landsAt_[slot % cfg_.capacity], std::memory_order_relaxed);
    return now >= landsAt_[slot % cfg_.capacity];
  }

  // The head is published but not due: waits a little toward its time, sleeping for
  // most of a wait longer than 200 us (the timer slack is 1 us).
  void awaitHead() const {
    const uint64_t now = nowNs(), headDue = headDueNs_.load(std::memory_order_relaxed);
    if (headDue > now + 200000) {
      const struct timespec ts = timespecOf(headDue - now - 100000);
      nanosleep(&ts, nullptr);
    } else if (headDue > now) {
      sched_yield();
    }
  }

 private:
  const CommrefGinEngineConfig& cfg_;
  const GinDescriptor* ring_;
  uint64_t stamped_ = 0, wireFreeNs_ = 0;  // the first slot not stamped yet; when the wire is next free
  std::atomic<uint64_t> headDueNs_{0};     // stored by the taker, read by the engine thread
  std::vector<uint64_t> landsAt_;          // each stamped slot's landing time
};

}  // namespace
