// The MPI network (built with COMMREF_GIN_MPI: native.py's mpi_library()): the engine's
// descriptors become messages to the peer's engine, which lands them in its own window.
//
// The protocol, between the engines of two ranks on their own communicator (one tag).
// Every message starts with an MpiHeader. MPI keeps the messages of one (source,
// communicator, tag) in order, and the receiver handles them one at a time, so what a
// rank's engine sends to a peer lands there in the order it was sent: the wire stays
// ordered per (peer, ctx), and a put's signal is applied after its data.
// The tag (CommrefGinEngineConfig.mpiTag) is the communicator's own (plan.py's
// network_tag()): a communicator freed at stop may have its context id reused by a later
// one, and a message still in flight on the old one must not match the new engines.
//   put (kMsgPut): offset = dst offset at the target, size = bytes (0: a bare signal),
//     the signal (flags kMsgHasSignal, kMsgVa; signal = index or VA offset; value). Up to
//     kMpiInlineBytes of data ride inline behind the header (copied: the source is
//     reusable at once); more follow as the next messages (kMsgDataFollows), sent from
//     the source itself, in chunks of at most kMpiChunkBytes, which the target receives
//     straight into its window. Such a put's source is reusable, and its counter
//     bumped, when those sends complete; a flush waits for every send to complete.
//   get (kMsgGetRequest): offset = src offset at the target, size, signal = dst offset
//     here, windows as the descriptor's; the target answers kMsgGetReply (offset = dst,
//     data as for a put), which the requester lands before its get's slot is consumed.
//   Offsets at the target are in the window that `windows` names there, checked there
//   (refusals naming the access "landing" or "get request", and the source rank).
// Polling: while sends or receives are in flight (Core::inFlight_) the engine yields but
// does not sleep (MPI moves their data only when polled).
#pragma once

#include "core.h"
#include "unordered.h"
#include "wire.h"

#ifdef COMMREF_GIN_MPI
#include <mpi.h>

#include <deque>
#include <type_traits>

#include "commref/land.h"

namespace {

struct MpiHeader {
  uint64_t kind, offset, size, flags, signal, value;
  uint64_t windows;  // put, get reply: ginWindows(0, the target's window); get request: the descriptor's
};
enum : uint64_t { kMsgPut = 1, kMsgGetRequest = 2, kMsgGetReply = 3 };
enum : uint64_t { kMsgHasSignal = 1, kMsgVa = 2, kMsgDataFollows = 4 };
constexpr uint64_t kMpiInlineBytes = 16 << 10;
constexpr uint64_t kMpiChunkBytes = 1ull << 30;  // MPI counts are int

// mpi4py's handle of a communicator: MPI_Comm's value (an int in MPICH, a pointer in Open MPI).
template <typename Comm>
Comm commFromHandle(uint64_t h) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(static_cast<uintptr_t>(h));
  } else {
    return static_cast<Comm>(h);
  }
}
constexpr bool kHaveMpi = true;

// The taker's (engine.cpp) MPI half: every method runs under the taker's turn.
class MpiNet {
 public:
  MpiNet(Core& core, Delivery& delivery) : core_(core), delivery_(delivery), cfg_(core.cfg_) {
    if (cfg_.network == kNetworkMpi) {
      comm_ = commFromHandle<MPI_Comm>(cfg_.mpiComm);
      landings_.resize((size_t)cfg_.nranks);
    }
  }

  // A put (putValue, signal) of `nbytes` from `src` with its signal `value`: sent to
  // d.peer. *counted: whether its counter (if `counter`) was bumped before this returns
  // (else it is when the sends complete).
  bool put(const GinDescriptor& d, const char* src, uint64_t nbytes, uint64_t value, bool counter, uint64_t seq,
           bool* counted) {
    MpiHeader h{kMsgPut, d.dstOffset, nbytes, 0, d.signal, value, ginWindows(0, ginDstWindow(d.windows))};
    if (d.flags & kGinHasSignal) h.flags |= kMsgHasSignal | (d.flags & kGinVaSignal ? kMsgVa : 0);
    // (a putValue's 8 bytes, which live in the descriptor, always go inline)
    return sendWithData(d.peer, h, src, nbytes, counter, &d, seq, counted);
  }

  // A packet of the unordered wire (a segment, or a signal): one message to its peer.
  bool deliver(const Packet& k) {
    GinDescriptor m{};
    m.peer = k.peer;
    m.ctx = k.ctx;
    bool counted = false;
    if (k.isSignal) {
      m.op = kGinSignal;
      m.flags = kGinHasSignal | (k.va ? kGinVaSignal : 0);
      m.signal = k.signal;
      return put(m, nullptr, 0, k.value, false, k.putSeq, &counted);
    }
    m.dstOffset = k.dstOffset;
    m.windows = ginWindows(0, k.dstWin);
    return put(m, k.data(), k.nbytes, 0, false, k.putSeq, &counted);
  }

  // A get: asks `d.peer` and lands its reply before the get's slot is consumed.
  bool get(const GinDescriptor& d) {
    getPeer_ = d.peer;
    bool counted = false;
    if (!sendWithData(d.peer, MpiHeader{kMsgGetRequest, d.srcOffset, d.bytes, 0, d.dstOffset, 0, d.windows}, nullptr, 0,
                      false, nullptr, 0, &counted))
      return false;
    return progressUntil([&] { return getPeer_ < 0; },
                         [&] {
                           return "getting " + std::to_string(d.bytes) + " bytes from peer " + std::to_string(d.peer) +
                                  " (expected its reply, seen none)";
                         });
  }

  // A flush: every send completes (its source reusable), while this engine keeps
  // receiving (a peer's flush may wait on this rank's receives).
  bool completeSends(int32_t ctx) {
    return progressUntil([&] { return sends_.empty(); },
                         [&] {
                           return "flushing context " + std::to_string(ctx) + " (expected its " +
                                  std::to_string(sends_.size()) + " sends to complete; the oldest goes to peer " +
                                  std::to_string(sends_.front().peer) + ")";
                         });
  }

  // Receives what peers sent (up to a budget) and completes sends; how many, or -1.
  int progress() {
    int n = 0;
    for (; n < 64; n++) {
      int flag = 0;
      MPI_Status st;
      const int rc = MPI_Iprobe(MPI_ANY_SOURCE, cfg_.mpiTag, comm_, &flag, &st);
      if (rc != MPI_SUCCESS) return mpiError("MPI_Iprobe", rc, -1), -1;
      if (!flag) break;
      if (!receive(st)) return -1;
    }
    const int landed = advanceLandings();
    const int reaped = landed < 0 ? -1 : reap();
    core_.inFlight_.store(sends_.size() + pendingLandings_, std::memory_order_release);
    return reaped < 0 ? -1 : n + landed + reaped;
  }

  // The thread ends (stopped, or failed) with receives into the window still posted:
  // they are cancelled so that nothing writes the window after it is freed.
  void abandon() {
    for (auto& q : landings_)
      for (auto& l : q)
        for (auto& r : l.reqs)
          if (r != MPI_REQUEST_NULL) {
            MPI_Cancel(&r);
            MPI_Request_free(&r);
          }
  }

 private:
  struct Send {
    MPI_Request req;
    char* staging;  // malloc'd header and inline data, freed once the send completes; or null
    bool counter;   // a zero-copy put's last send: bump its counter on completion
    uint32_t counterId;
    int32_t peer, ctx;
    uint64_t seq;  // the put's seq on its link (the trace's counter record)
  };

  bool fail(const std::string& msg) { return core_.fail(core_.who() + "GIN MPI network: " + msg); }

  bool mpiError(const char* call, int rc, int32_t peer) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = std::snprintf(text, sizeof text, "error %d", rc);
    return fail(std::string(call) + " (peer " + std::to_string(peer) + ") failed: " + std::string(text, (size_t)len));
  }

  bool isend(int32_t peer, const void* buf, uint64_t bytes, char* staging, bool counter, const GinDescriptor* d,
             uint64_t seq) {
    Send s{MPI_REQUEST_NULL, staging, counter, d ? d->counter : 0, peer, d ? d->ctx : 0, seq};
    const int rc = MPI_Isend(buf, (int)bytes, MPI_BYTE, peer, cfg_.mpiTag, comm_, &s.req);
    if (rc != MPI_SUCCESS) {
      std::free(staging);
      return mpiError("MPI_Isend", rc, peer);
    }
    sends_.push_back(s);
    core_.inFlight_.store(sends_.size(), std::memory_order_release);
    return true;
  }

  // Sends header `h` with `bytes` of `data` to `peer` (inline, or following from `data`
  // itself). *counted: whether the put's counter (if `counter`) was bumped here.
  bool sendWithData(int32_t peer, MpiHeader h, const char* data, uint64_t bytes, bool counter, const GinDescriptor* d,
                    uint64_t seq, bool* counted) {
    const bool inlined = bytes <= kMpiInlineBytes;
    if (!inlined) h.flags |= kMsgDataFollows;
    const uint64_t msgBytes = sizeof h + (inlined ? bytes : 0);
    char* staging = static_cast<char*>(std::malloc(msgBytes));
    if (staging == nullptr) return fail("out of memory for a " + std::to_string(msgBytes) + "-byte message");
    std::memcpy(staging, &h, sizeof h);
    if (inlined && bytes) std::memcpy(staging + sizeof h, data, bytes);
    if (!isend(peer, staging, msgBytes, staging, false, d, seq)) return false;
    *counted = false;
    if (inlined) {
      if (counter) core_.bumpCounter(d->counter);
      *counted = counter;
      return true;
    }
    for (uint64_t off = 0; off < bytes; off += kMpiChunkBytes) {
      const uint64_t n = bytes - off < kMpiChunkBytes ? bytes - off : kMpiChunkBytes;
      if (!isend(peer, data + off, n, nullptr, counter && off + n == bytes, d, seq)) return false;
    }
    return true;
  }

  // Completes sends in order while the oldest has completed; bumps zero-copy puts'
  // counters. Sends completed, or -1 on error.
  int reap() {
    int n = 0;
    while (!sends_.empty()) {
      Send& s = sends_.front();
      int done = 0;
      const int rc = MPI_Test(&s.req, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return mpiError("MPI_Test", rc, s.peer), -1;
      if (!done) break;
      if (s.counter) {
        core_.bumpCounter(s.counterId);
        if (delivery_.tracing()) {
          const CommrefGinTraceRecord r{s.peer, s.ctx, kTraceCounter, 0, s.seq, s.counterId, 0, 0, 0};
          delivery_.record(&r, 1);
        }
      }
      std::free(s.staging);
      sends_.pop_front();
      n++;
    }
    core_.inFlight_.store(sends_.size(), std::memory_order_release);
    return n;
  }

  // A bounded wait's check: false (failed, with a message naming what() was awaited: a
  // callable, so the message is built only then) past the deadline or once the job aborts.
  template <typename What>
  bool keepWaiting(const Clock::time_point& deadline, What what) {
    if (__atomic_load_n(reinterpret_cast<const uint64_t*>(cfg_.abortWord), __ATOMIC_ACQUIRE) != 0)
      return fail("the job aborted while " + what());
    if (Clock::now() > deadline) return fail("timed out after " + std::to_string(cfg_.timeoutS) + " s " + what());
    return true;
  }

  Clock::duration timeout() const {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg_.timeoutS));
  }

  // Makes progress (receiving too: a peer may be waiting on this rank) until done(),
  // within the timeout; false on failure or at the deadline (what(): keepWaiting's).
  template <typename Done, typename What>
  bool progressUntil(Done done, What what) {
    const auto end = Clock::now() + timeout();
    for (uint32_t spins = 0; !done(); spins++) {
      if (progress() < 0) return false;
      if (done()) break;
      if ((spins & 63) == 0 && !keepWaiting(end, what)) return false;
      waitPause(spins);
    }
    return true;
  }

  static void waitPause(uint32_t spins) {
    if (spins < 256)
      cpuPause();
    else
      sched_yield();
  }

  // What a message from a peer does here, done in arrival order per source once its
  // data is in the window: a put's data (received straight into the window: `reqs`; or
  // inline, `held` when it arrived behind an unfinished landing) and then its signal; a
  // get reply's data; a get request's reply (after every earlier put of that source).
  struct Landing {
    MpiHeader h;
    std::vector<MPI_Request> reqs;  // receives of the data that follows the header
    std::vector<char> held;         // inline data kept until the landings before it finish
    char* at = nullptr;             // where its data lands (put, get reply) or is read (get request) here
    Clock::time_point since;        // when the header came (the deadline of its data)
  };

  // Does what `l`, whose data is in the window, leaves to do. False on failure.
  bool finish(int32_t src, Landing& l) {
    const MpiHeader& h = l.h;
    if (!l.held.empty()) landLines(l.at, l.held.data(), l.held.size());
    if (h.kind == kMsgPut && (h.flags & kMsgHasSignal)) {  // after its data: release
      const uint64_t where = h.flags & kMsgVa ? h.signal : cfg_.signalsOff + 8 * h.signal;
      __atomic_fetch_add(reinterpret_cast<uint64_t*>(core_.here_ + where), h.value, __ATOMIC_RELEASE);
    } else if (h.kind == kMsgGetReply) {
      getPeer_ = -1;
    } else if (h.kind == kMsgGetRequest) {
      bool counted = false;
      return sendWithData(src,
                          MpiHeader{kMsgGetReply, h.signal, h.size, 0, 0, 0, ginWindows(0, ginDstWindow(h.windows))},
                          l.at, h.size, false, nullptr, 0, &counted);
    }
    return true;
  }

  // Finishes, per source and in order, the landings whose data has arrived; how many, or -1.
  int advanceLandings() {
    if (pendingLandings_ == 0) return 0;
    int n = 0;
    for (int32_t src = 0; src < cfg_.nranks; src++) {
      auto& q = landings_[src];
      while (!q.empty()) {
        Landing& l = q.front();
        if (!l.reqs.empty()) {
          int done = 0;
          const int rc = MPI_Testall((int)l.reqs.size(), l.reqs.data(), &done, MPI_STATUSES_IGNORE);
          if (rc != MPI_SUCCESS) return mpiError("MPI_Testall", rc, src), -1;
          if (!done) {
            if (!keepWaiting(l.since + timeout(), [&] {
                  return "receiving " + std::to_string(l.h.size) + " bytes of data from peer " + std::to_string(src) +
                         " (expected after its header, not all seen)";
                }))
              return -1;
            break;
          }
          l.reqs.clear();
        }
        if (!finish(src, l)) return -1;
        q.pop_front();
        pendingLandings_--;
        n++;
      }
    }
    return n;
  }

  // Receives and handles one message (its header) that MPI_Iprobe found.
  bool receive(const MPI_Status& st) {
    int count = 0;
    const int32_t src = st.MPI_SOURCE;
    int rc = MPI_Get_count(&st, MPI_BYTE, &count);
    if (rc != MPI_SUCCESS) return mpiError("MPI_Get_count", rc, src);
    rbuf_.resize((size_t)count);
    rc = MPI_Recv(rbuf_.data(), count, MPI_BYTE, src, cfg_.mpiTag, comm_, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return mpiError("MPI_Recv", rc, src);
    if ((size_t)count < sizeof(MpiHeader) || src < 0 || src >= cfg_.nranks)
      return fail("a " + std::to_string(count) + "-byte message from peer " + std::to_string(src) +
                  " is not one of this engine's");
    Landing l;
    std::memcpy(&l.h, rbuf_.data(), sizeof l.h);
    const MpiHeader& h = l.h;
    const uint64_t bodyBytes = (uint64_t)count - sizeof h;
    if (h.kind != kMsgPut && h.kind != kMsgGetRequest && h.kind != kMsgGetReply)
      return fail("a message of unknown kind " + std::to_string(h.kind) + " from peer " + std::to_string(src));
    const bool request = h.kind == kMsgGetRequest;
    const uint32_t op = h.kind == kMsgPut ? kGinPut : kGinGet;
    l.at = core_.at(request ? ginSrcWindow(h.windows) : ginDstWindow(h.windows), cfg_.rank, h.offset, h.size,
                    request ? kGinAccessGetRequest : kGinAccessLanding, op, src);
    if (l.at == nullptr) return false;
    if (h.kind == kMsgPut && (h.flags & kMsgHasSignal) &&
        !core_.known(0, h.flags & kMsgVa ? h.signal : cfg_.signalsOff + 8 * h.signal, 8, kGinAccessSignal, op, src))
      return false;
    if (h.kind == kMsgGetReply && src != getPeer_)
      return fail("a get reply from peer " + std::to_string(src) + ", expected " +
                  (getPeer_ < 0 ? std::string("none") : "one from peer " + std::to_string(getPeer_)));
    auto& q = landings_[src];
    if (h.kind != kMsgGetRequest && (h.flags & kMsgDataFollows)) {  // receives straight into the window, in order
      for (uint64_t off = 0; off < h.size; off += kMpiChunkBytes) {
        const uint64_t n = h.size - off < kMpiChunkBytes ? h.size - off : kMpiChunkBytes;
        l.reqs.push_back(MPI_REQUEST_NULL);
        rc = MPI_Irecv(l.at + off, (int)n, MPI_BYTE, src, cfg_.mpiTag, comm_, &l.reqs.back());
        if (rc != MPI_SUCCESS) return mpiError("MPI_Irecv", rc, src);
      }
    } else if (h.kind != kMsgGetRequest) {
      if (bodyBytes != h.size)
        return fail("a message from peer " + std::to_string(src) + " carries " + std::to_string(bodyBytes) +
                    " bytes of data, its header says " + std::to_string(h.size));
      if (q.empty()) {  // nothing of this source before it is unfinished: land it now
        if (h.size) landLines(l.at, rbuf_.data() + sizeof h, h.size);
        return finish(src, l);
      }
      l.held.assign(rbuf_.data() + sizeof h, rbuf_.data() + count);
    } else if (q.empty()) {
      return finish(src, l);
    }
    l.since = Clock::now();
    q.push_back(std::move(l));
    pendingLandings_++;
    return true;
  }

  Core& core_;
  Delivery& delivery_;
  const CommrefGinEngineConfig& cfg_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  // In flight, oldest first. Sends still in flight when the engine is destroyed (after
  // a failure) keep their staging buffers: MPI may still read them.
  std::deque<Send> sends_;
  std::vector<char> rbuf_;                     // the message being received
  std::vector<std::deque<Landing>> landings_;  // per source: unfinished landings, oldest first
  uint64_t pendingLandings_ = 0;               // in landings_, all sources
  int32_t getPeer_ = -1;                       // the peer whose get reply is awaited, or -1
};

}  // namespace

#else  // built without MPI: network mpi is refused at create; these are never reached

namespace {

constexpr bool kHaveMpi = false;

class MpiNet {
 public:
  MpiNet(Core& core, Delivery&) : core_(core) {}
  bool put(const GinDescriptor&, const char*, uint64_t, uint64_t, bool, uint64_t, bool*) { return unbuilt(); }
  bool get(const GinDescriptor&) { return unbuilt(); }
  bool completeSends(int32_t) { return unbuilt(); }
  bool deliver(const Packet&) { return unbuilt(); }
  int progress() { return 0; }
  void abandon() {}

 private:
  bool unbuilt() { return core_.fail(core_.who() + "GIN MPI network: this engine was built without MPI"); }
  Core& core_;
};

}  // namespace

#endif
