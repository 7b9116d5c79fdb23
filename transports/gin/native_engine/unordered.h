// The native engine's UNORDERED wire (SRD-like): what the taker has taken and not yet
// landed, per (peer, ctx) link, and the seeded adversary that decides when and in which
// order it lands; the same rules as transports/gin/scheduler.py's doorbell mode (the
// draws come from a stream of this file's, so the same seed gives the same orders run
// after run here, not the Python proxy's orders).
//
// A put (putValue, bare signal) is taken into its link (post); nothing lands before the
// link's next doorbell. At doorbell d of a link, with a stream of its own (seed, rank,
// peer, ctx, d):
//   1. each put posted since the previous doorbell is held with probability 1/4
//      (kHoldOneIn), for 1..kHoldDoorbells later doorbells of the link (its bound); a
//      held put lands nothing until released (its source is read when it lands, and its
//      counter bumped then: GIN lets a kernel reuse a source only after its counter or a
//      flush, and a flush copies the sources of what has not landed);
//   2. a held put is released (forced) when its bound expires, or when a later put of
//      the link that lands now needs it: a strong signal, or where the backend promises
//      that local completion orders later writes, a put posted after a flush. A put that
//      would be forced at its own doorbell is not held;
//   3. the released puts land first, in sequence order, each in an order drawn from its
//      own stream (seed, rank, peer, ctx, seq); then the rest of the batch, in an order
//      drawn from the doorbell's stream among the events semantics.enabled() allows:
//      segments (cut at multiples of segmentBytes of the destination address) in any
//      order, a duplicate of each segment after its original when the wire duplicates,
//      a weak signal once its own data has landed, a strong one once its put's and every
//      earlier put's data of the link has landed and every earlier strong signal of the
//      link is applied.
// Liveness without a timer: a sender may wait on a held put with nothing more to post,
// so once the takers have found the queue empty releasePolls times in a row with puts
// held (an event count: the waiting kernels' help calls and the engine thread's polls),
// every held put is released, per link in sequence order, each in its pre-drawn order.
// A held put that a later signal to its peer has overtaken (applied while the held one
// waits, on any context: what a receiver can be fooled by) is held for overtakenPolls
// empty polls instead, or until overtakenNs have passed since the first of them if that
// is sooner (at least releasePolls polls either way), so that a receiver has time to act
// on that signal: a count alone would be a few hundred nanoseconds where the takers poll
// fast and tens of microseconds where they yield. A held put nothing overtook only delays
// its own signal, and goes after releasePolls. A CPU block that ends makes the polls its
// waits would have made, up to overtakenPolls while puts are held (Engine::ended, through
// the queue's end hook; idle.h, HeldRelease): as a kernel ends the count is what gives a
// receiver time, so that a put held then does not wait for the engine thread's next wake.
// Links that ring no doorbells (raw device API use, host producers) are served at the
// end of each pass over the queue, as one batch with no holds; where the kernels ring
// doorbells (config `batched`) every link is served at its doorbells from its first put,
// so that a pass ending between a link's first put and its first doorbell lands nothing.
//
// A flush of a context stages the sources of its puts not landed yet (they are reusable
// when the flush returns) and marks the next put of each link of the context.
//
// Multi-path spraying (config `paths` > 1, GinOptions.wire_paths; SRD's paths): what a
// set of puts lands (a doorbell's batch, a released put) is packets, each data segment,
// each duplicate and each signal one, sent in post order, each on a path drawn from the
// set's stream: path i takes (paths + i) / paths times the base latency (the wire model's
// latency, else kPathLatencyNs) plus a jitter of up to a quarter of it, and sends at
// 1 / paths of the rate (the wire model's, else kPathBytesPerNs), one packet after
// another; a path delivers in the order it sends (SRD's disorder is between paths).
// The set lands in arrival order among the events semantics.enabled() allows (a signal
// not yet enabled when it arrives lands as soon as it is; a duplicate after its
// original), instead of the uniform draw, so the disorder is the paths'. The times
// order the landings only: they are the model's, not the clock's (the wire model paces
// the wire as one link, wire.h).
#pragma once

#include <algorithm>
#include <deque>
#include <memory>
#include <tuple>

#include "core.h"

namespace {

constexpr uint32_t kHoldOneIn = 4;         // a put is held with probability 1/kHoldOneIn (scheduler.HOLD_PROBABILITY)
constexpr uint64_t kHoldDoorbells = 4;     // ... for 1..this many later doorbells (scheduler.HOLD_DOORBELLS)
constexpr uint64_t kPathLatencyNs = 2000;  // spraying without a wire model: a path's base latency
constexpr double kPathBytesPerNs = 12.5;   // ... and the link's rate (100 Gb/s), shared by its paths

// A seeded stream (splitmix64) keyed by the numbers that name it.
class Stream {
 public:
  Stream(uint64_t seed, uint64_t a, uint64_t b, uint64_t c, uint64_t d) : s_(seed) {
    for (uint64_t k : {a, b, c, d}) s_ = mix(s_ ^ (k + 0x9e3779b97f4a7c15ull));
  }
  uint64_t next() { return mix(s_ += 0x9e3779b97f4a7c15ull); }
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }

 private:
  static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t s_;
};

enum : uint64_t { kStreamDoorbell = 1, kStreamPut = 2, kStreamUnrung = 3, kStreamContext = 4 };

// Per segment of a put, the copies of it placed so far: inline up to kInline segments (a
// put of up to 16 segments, the common case, allocates nothing), on the heap beyond.
class SegmentCopies {
 public:
  void assign(uint64_t n, uint8_t v) {
    n_ = n;
    heap_.reset(n > kInline ? new uint8_t[n] : nullptr);
    std::fill(data(), data() + n, v);
  }
  uint64_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  uint8_t& operator[](uint64_t k) { return data()[k]; }
  uint8_t operator[](uint64_t k) const { return data()[k]; }
  uint8_t* begin() { return data(); }
  uint8_t* end() { return data() + n_; }
  const uint8_t* begin() const { return data(); }
  const uint8_t* end() const { return data() + n_; }

 private:
  static constexpr uint64_t kInline = 16;
  uint8_t* data() { return heap_ ? heap_.get() : inline_; }
  const uint8_t* data() const { return heap_ ? heap_.get() : inline_; }
  uint64_t n_ = 0;
  std::unique_ptr<uint8_t[]> heap_;
  uint8_t inline_[kInline] = {};
};

// One put taken and not fully landed.
struct Pending {
  int32_t peer = 0, ctx = 0;
  uint64_t seq = 0;
  bool hasSignal = false, strong = false, va = false, counter = false, counted = false, afterFlush = false;
  bool signalDone = false, stagedSrc = false, bulk = false;
  uint32_t counterId = 0, dstWin = 0;
  uint64_t signal = 0, value = 0, dstOffset = 0, nbytes = 0;
  const char* src = nullptr;  // the source (this window, or staged below)
  char* dst = nullptr;        // network shm: where the data lands
  std::vector<char> staged;   // the source's copy, once staged (putValue: its 8 bytes always)
  SegmentCopies landed;       // per segment: copies placed
  uint64_t dataLeft = 0;      // segments whose original has not landed
  uint64_t heldUntil = 0;     // 0: not held; else the doorbell that releases it at the latest
  bool inBatch = false, overtaken = false;
  uint32_t signalKey = 0;  // the unordered wire's landSet: its signal's index there

  uint64_t nseg(uint64_t sb) const { return nbytes ? (dstOffset + nbytes - 1) / sb - dstOffset / sb + 1 : 0; }
  // Segment k: [*off, *off + *n) of the destination.
  void segment(uint64_t sb, uint64_t k, uint64_t* off, uint64_t* n) const {
    const uint64_t first = dstOffset / sb, end = dstOffset + nbytes;
    const uint64_t lo = k == 0 ? dstOffset : (first + k) * sb, hi = (first + k + 1) * sb;
    *off = lo;
    *n = (hi < end ? hi : end) - lo;
  }
  bool done() const { return dataLeft == 0 && (!hasSignal || signalDone); }
};

// One landing: segment `segment` (copy 1: a duplicate) of `put`, or its signal (segment -1).
struct Landing {
  Pending* put;
  int64_t segment;
  uint32_t copy;
  uint64_t at = 0;              // spraying: its arrival, in the paths' time
  const char* ahead = nullptr;  // the source of the segment that lands next (if known: to prefetch) ...
  uint64_t aheadBytes = 0;      // ... and its bytes
};

// One landing as a network carries it (ShmNet::deliver, MpiNet::deliver), and the lossy
// link (lossy.h) sends it.
struct Packet {
  int32_t peer = 0, ctx = 0;
  bool isSignal = false, va = false, bulk = false;
  uint32_t dstWin = 0;
  uint64_t putSeq = 0;                 // the put's seq on its link (messages name it)
  uint64_t dstOffset = 0, nbytes = 0;  // data: where (the destination window) and how much
  uint64_t whole = 0;                  // data: the bytes of the put it is a segment of
  char* dst = nullptr;                 // network shm: where the data lands
  uint64_t signal = 0, value = 0;      // signal: index or VA offset, value
  const char* src = nullptr;           // the data, or null once copied into `bytes`
  std::vector<char> bytes;             // the data's copy (a packet not delivered as sent)
  const char* ahead = nullptr;         // Landing's: the next segment's source, to prefetch ...
  uint64_t aheadBytes = 0;             // ... and its bytes
  const char* data() const { return src ? src : bytes.data(); }
  static Packet of(const Pending& p) {  // the put's fields (a segment's are the caller's)
    Packet k;
    std::tie(k.peer, k.ctx, k.va, k.bulk, k.dstWin, k.putSeq, k.signal, k.value) =
        std::tie(p.peer, p.ctx, p.va, p.bulk, p.dstWin, p.seq, p.signal, p.value);
    return k;
  }
};

// The links' pending puts and the adversary; decides the landings, which the engine
// carries (its land callback: a Landing, and whether the put's data is now complete).
class UnorderedWire {
 public:
  explicit UnorderedWire(const CommrefGinEngineConfig& c)
      : cfg_(c),
        sb_(c.segmentBytes ? c.segmentBytes : 4096),
        strongAlways_(c.strongAlways != 0),
        paths_(c.paths > 1 ? (uint32_t)c.paths : 1),
        pathFree_(paths_, 0),
        pathLast_(paths_, 0) {
    const uint64_t base = c.wireLatencyNs ? c.wireLatencyNs : kPathLatencyNs;
    const double rate = (c.wireBytesPerS > 0 ? c.wireBytesPerS / 1e9 : kPathBytesPerNs) / paths_;
    for (uint32_t i = 0; i < paths_; i++) pathLatencyNs_.push_back(base * (paths_ + i) / paths_);
    pathNsPerByte_ = 1.0 / rate;
  }

  struct Link {
    std::deque<Pending> puts;  // posted, not fully landed, in sequence order
    uint64_t doorbells = 0, batchStart = 0, nextSeq = 0;
    bool rung = false, afterFlush = false;
    int32_t peer = 0, ctx = 0;
  };

  Link& link(int32_t peer, int32_t ctx) {
    return links_.at(peer, ctx, [this](Link& l) {
      l.rung = cfg_.batched != 0;
      for (int32_t f : flushedCtx_)
        if (f == l.ctx) l.afterFlush = true;
    });
  }

  uint64_t held() const { return held_; }
  uint64_t overtaken() const { return overtaken_; }
  uint64_t pending() const { return pending_; }
  uint64_t segmentBytes() const { return sb_; }

  // Takes a put into its link (the fields filled by the engine but seq, segments and the
  // flush mark); returns it.
  Pending& post(Pending&& p) {
    Link& l = link(p.peer, p.ctx);
    p.seq = l.nextSeq++;
    p.afterFlush = l.afterFlush && cfg_.flushOrdersLaterWrites;
    l.afterFlush = false;
    for (size_t i = 0; i < flushedCtx_.size(); i++)
      if (flushedCtx_[i] == p.ctx) flushedCtx_.erase(flushedCtx_.begin() + (long)i--);
    const uint64_t n = p.nseg(sb_);
    p.landed.assign(n, 0);
    p.dataLeft = n;
    l.puts.push_back(std::move(p));
    pending_++;
    if (!l.rung) unrung_ = true;
    return l.puts.back();
  }

  // A flush of `ctx`: stages every pending put of the context (stage: the engine's copy
  // of the source and its counter), marks the next put of each of its links.
  template <typename Stage, typename Traced>
  void flush(int32_t ctx, Stage stage, Traced traced) {
    for (auto& kv : links_) {
      Link& l = kv.second;
      if (l.ctx != ctx) continue;
      l.afterFlush = true;
      traced(l.peer, l.ctx);
      for (Pending& p : l.puts) stage(p);
    }
    flushedCtx_.push_back(ctx);
  }

  // Doorbell d of (peer, ctx): holds, releases, lands (above). hold(p, until) and
  // release(p, why) record; land(Landing) carries one landing. False when a put could
  // not land (an engine bug: the message says).
  template <typename Hold, typename Release, typename Land>
  bool doorbell(Link& l, Hold hold, Release release, Land land, std::string* why) {
    const uint64_t d = ++l.doorbells;
    l.rung = true;
    Stream rng(cfg_.seed, (uint64_t)cfg_.rank, (uint64_t)l.peer, (uint64_t)l.ctx, (kStreamDoorbell << 48) | d);
    std::vector<Pending*>&batch = batch_, &released = released_;
    batch.clear();
    released.clear();
    for (Pending& p : l.puts) {
      if (p.seq < l.batchStart) continue;
      if (rng.below(kHoldOneIn) == 0) { p.heldUntil = d + 1 + rng.below(kHoldDoorbells); }
      batch.push_back(&p);
    }
    l.batchStart = l.nextSeq;
    if (batch.empty()) return true;
    // What lands now needs every held put before its last forcing put: released (or not held).
    for (Pending& p : l.puts)
      if (p.heldUntil && !p.inBatch && p.seq < batch.front()->seq && p.heldUntil <= d) p.inBatch = true;
    for (;;) {
      int64_t needs = -1;
      for (Pending& p : l.puts) {
        const bool landsNow = p.seq >= batch.front()->seq ? !p.heldUntil : p.inBatch;
        if (landsNow && forcing(p)) needs = (int64_t)p.seq;
      }
      bool more = false;
      for (Pending& p : l.puts) {
        if ((int64_t)p.seq >= needs) break;
        if (p.seq >= batch.front()->seq && p.heldUntil) {
          p.heldUntil = 0;  // forced at its own doorbell: not held after all
          more = true;
        } else if (p.seq < batch.front()->seq && p.heldUntil && !p.inBatch) {
          p.inBatch = true;
          more = true;
        }
      }
      if (!more) break;
    }
    for (Pending* p : batch)
      if (p->heldUntil) {
        hold(*p, p->heldUntil);
        held_++;
      }
    for (Pending& p : l.puts)
      if (p.seq < batch.front()->seq && p.inBatch) released.push_back(&p);
    for (Pending* p : released) {
      release(*p, p->heldUntil <= d ? kReleaseExpired : kReleaseForced);
      unhold(*p);
      p->inBatch = false;
      if (!landOne(l, p, land, why)) return false;
    }
    std::vector<Pending*>& now = now_;
    now.clear();
    for (Pending* p : batch)
      if (!p->heldUntil) now.push_back(p);
    if (!landSet(l, now, rng, land, why)) return false;
    prune(l);
    return true;
  }

  // Every held put, per link in sequence order (the takers found the queue empty).
  template <typename Release, typename Land>
  bool releaseHeld(Release release, Land land, std::string* why) {
    for (auto& kv : links_) {
      Link& l = kv.second;
      for (Pending& p : l.puts) {
        if (!p.heldUntil) continue;
        release(p, kReleaseIdle);
        unhold(p);
        if (!landOne(l, &p, land, why)) return false;
      }
      prune(l);
    }
    return true;
  }

  // Links that ring no doorbells: everything they hold lands now, as one batch each.
  template <typename Land>
  bool serveUnrung(Land land, std::string* why) {
    if (!unrung_) return true;
    unrung_ = false;
    for (auto& kv : links_) {
      Link& l = kv.second;
      if (l.rung || l.puts.empty()) continue;
      std::vector<Pending*>& now = now_;
      now.clear();
      for (Pending& p : l.puts) now.push_back(&p);
      Stream rng(cfg_.seed, (uint64_t)cfg_.rank, (uint64_t)l.peer, (uint64_t)l.ctx, (kStreamUnrung << 48) | l.nextSeq);
      if (!landSet(l, now, rng, land, why)) return false;
      prune(l);
    }
    return true;
  }

  enum : uint32_t { kReleaseExpired = 0, kReleaseForced = 1, kReleaseIdle = 2 };

 private:
  void unhold(Pending& p) {
    p.heldUntil = 0;
    held_--;
    if (p.overtaken) overtaken_--;
    p.overtaken = false;
  }

  // A signal to `peer` was applied: every put held on a link to that peer (any context) is
  // overtaken (a receiver may act on that signal while the held put is missing).
  void overtake(int32_t peer) {
    if (held_ == overtaken_) return;
    for (auto& kv : links_) {
      if (kv.second.peer != peer) continue;
      for (Pending& q : kv.second.puts)
        if (q.heldUntil && !q.overtaken) {
          q.overtaken = true;
          overtaken_++;
        }
    }
  }

  bool forcing(const Pending& p) const {
    if (p.hasSignal && (p.strong || strongAlways_)) return true;
    return p.afterFlush;
  }

  template <typename Land>
  bool landOne(Link& l, Pending* p, Land land, std::string* why) {
    Stream rng(cfg_.seed, (uint64_t)cfg_.rank, (uint64_t)l.peer, (uint64_t)l.ctx, (kStreamPut << 48) | p->seq);
    one_.assign(1, p);
    return landSet(l, one_, rng, land, why);
  }

  // Whether every put of `l` before `p` has its data landed (and, `strongToo`, its strong signal applied).
  bool earlierLanded(const Link& l, const Pending* p, bool strongToo) const {
    for (const Pending& q : l.puts) {
      if (&q == p) return true;
      if (q.dataLeft) return false;
      if (strongToo && q.hasSignal && (q.strong || strongAlways_) && !q.signalDone) return false;
    }
    return true;
  }

  // Lands every event of the puts `set` in an order drawn from `rng` among those enabled.
  // The signals not landed yet are kept in post order (`signals`, a signal's key its
  // index there); the keys of those enabled in `ready`, added as landings enable more: a
  // weak signal once its own data has landed, a strong one or one after a flush (the
  // "conditional" ones) looked at again whenever a put's data completes or a strong
  // signal lands. Enabled stays enabled (data and strong signals only land), so the draw
  // is among exactly the events enabled; `pool` and `ready` are unordered sets (a landing
  // drawn is replaced by the last), so a landing costs O(1), and the order is a function
  // of the seed and the posted sequence alone.
  template <typename Land>
  bool landSet(Link& l, std::vector<Pending*>& set, Stream& rng, Land land, std::string* why) {
    std::vector<Landing>& pool = pool_;  // data landings enabled now
    std::vector<Pending*>& blocked = blocked_;
    std::vector<Signal>& signals = signals_;
    std::vector<uint32_t>&ready = ready_, &waiting = waiting_;  // keys: enabled; conditional, not yet
    pool.clear();
    blocked.clear();
    signals.clear();
    ready.clear();
    waiting.clear();
    const bool sprayed = paths_ > 1;
    uint64_t now = 0;  // spraying: the arrival of the last landing
    if (sprayed) {
      std::fill(pathFree_.begin(), pathFree_.end(), 0);
      std::fill(pathLast_.begin(), pathLast_.end(), 0);
    }
    auto segmentOf = [&](Pending* p, uint64_t k, uint32_t copy) {
      Landing e{p, (int64_t)k, copy};
      if (sprayed) {
        uint64_t off, n;
        p->segment(sb_, k, &off, &n);
        e.at = std::max(send(rng, n), now);
      }
      return e;
    };
    auto enabled = [&](const Pending* p) {
      return !p->dataLeft && (!(p->strong || strongAlways_) || earlierLanded(l, p, true)) &&
             (!p->afterFlush || earlierLanded(l, p, false));
    };
    auto enable = [&](uint32_t key) { ready.push_back(key); };
    auto lookAgain = [&] {  // the conditional signals not enabled yet
      size_t kept = 0;
      for (uint32_t key : waiting)
        if (enabled(signals[key].put))
          enable(key);
        else
          waiting[kept++] = key;
      waiting.resize(kept);
    };
    for (Pending* p : set) {
      if (p->afterFlush && !earlierLanded(l, p, false)) {
        blocked.push_back(p);
      } else {
        for (uint64_t k = 0; k < p->landed.size(); k++)
          if (!p->landed[k]) pool.push_back(segmentOf(p, k, 0));
      }
      if (p->hasSignal && !p->signalDone) {
        const uint32_t key = (uint32_t)signals.size();
        p->signalKey = key;
        signals.push_back({p, sprayed ? send(rng, 8) : 0});
        if (enabled(p))
          ready.push_back(key);
        else if (p->strong || strongAlways_ || p->afterFlush)
          waiting.push_back(key);
      }
    }
    for (;;) {
      for (size_t i = 0; i < blocked.size(); i++)
        if (earlierLanded(l, blocked[i], false)) {
          for (uint64_t k = 0; k < blocked[i]->landed.size(); k++)
            if (!blocked[i]->landed[k]) pool.push_back(segmentOf(blocked[i], k, 0));
          blocked.erase(blocked.begin() + (long)i--);
        }
      const uint64_t n = pool.size() + ready.size();
      if (n == 0) break;
      const uint64_t r = sprayed ? earliest(pool, ready, now) : rng.below(n);
      Landing e;
      if (r < pool.size()) {
        e = pool[r];
        pool[r] = pool.back();
        pool.pop_back();
      } else {
        const Signal& g = signals[ready[r - pool.size()]];
        e = {g.put, -1, 0, std::max(g.at, now)};
        ready[r - pool.size()] = ready.back();
        ready.pop_back();
      }
      now = std::max(now, e.at);
      if (!sprayed && e.segment >= 0) lookAhead(e, pool, ready.size(), rng);
      bool changed = false;  // a put's data completed or a strong signal landed
      if (e.segment >= 0) {
        e.put->landed[(size_t)e.segment]++;
        if (e.copy == 0) {
          changed = --e.put->dataLeft == 0;
          if (cfg_.duplicates) pool.push_back(segmentOf(e.put, (uint64_t)e.segment, 1));
          Pending* p = e.put;  // its own weak signal, if it waits only for this data
          if (changed && p->hasSignal && !p->signalDone && !(p->strong || strongAlways_) && !p->afterFlush)
            enable(p->signalKey);
        }
      } else {
        e.put->signalDone = true;
        changed = e.put->strong || strongAlways_;
        overtake(l.peer);
      }
      if (changed && !waiting.empty()) lookAgain();
      if (!land(e)) return false;
      if (e.put->done()) pending_--;
    }
    for (Pending* p : set)
      if (!p->done()) {
        *why = "put " + std::to_string(p->seq) + " to peer " + std::to_string(l.peer) + " on context " +
               std::to_string(l.ctx) + " could not land (an earlier put of its link is still held)";
        return false;
      }
    return true;
  }

  // The data segment that lands after `e` (taken from `pool`, not landed yet) where the
  // draw can tell: when landing e enables nothing new (a duplicate, or not its put's last
  // segment), the next draw is rng's next below what is left. Its source goes with e, to
  // be prefetched while e's bytes are copied; the draw itself is not changed.
  void lookAhead(Landing& e, const std::vector<Landing>& pool, uint64_t ready, const Stream& rng) const {
    if (e.copy == 0 && e.put->dataLeft <= 1) return;
    const bool dup = e.copy == 0 && cfg_.duplicates;  // e's duplicate joins the pool after it
    Stream peek = rng;
    const uint64_t r = peek.below(pool.size() + (dup ? 1 : 0) + ready);
    if (r >= pool.size()) return;  // e's duplicate (its source is e's) or a signal
    uint64_t off, n;
    pool[r].put->segment(sb_, (uint64_t)pool[r].segment, &off, &n);
    e.ahead = pool[r].put->src + (off - pool[r].put->dstOffset);
    e.aheadBytes = n;
  }

  // Spraying: a packet of `bytes` sent on a path drawn from `rng` when that path is free;
  // its arrival.
  uint64_t send(Stream& rng, uint64_t bytes) {
    const uint32_t path = (uint32_t)rng.below(paths_);
    const uint64_t latency = pathLatencyNs_[path];
    pathFree_[path] += (uint64_t)((double)bytes * pathNsPerByte_);
    const uint64_t at = pathFree_[path] + latency + rng.below(latency / 4 + 1);
    pathLast_[path] = std::max(pathLast_[path], at);  // a path delivers in the order it sends
    return pathLast_[path];
  }

  // Spraying: the index (pool first, then the ready signals) of the earliest arrival.
  uint64_t earliest(const std::vector<Landing>& pool, const std::vector<uint32_t>& ready, uint64_t now) const {
    uint64_t best = 0, at = ~0ull;
    for (size_t i = 0; i < pool.size(); i++)
      if (pool[i].at < at) at = pool[i].at, best = i;
    for (size_t i = 0; i < ready.size(); i++) {
      const uint64_t t = std::max(signals_[ready[i]].at, now);  // a signal lands once it is enabled
      if (t < at) at = t, best = pool.size() + i;
    }
    return best;
  }

  // Drops the fully landed prefix.
  static void prune(Link& l) {
    while (!l.puts.empty() && l.puts.front().done() && !l.puts.front().heldUntil) l.puts.pop_front();
  }

  const CommrefGinEngineConfig& cfg_;
  const uint64_t sb_;
  const bool strongAlways_;
  LinkMap<Link> links_;
  std::vector<int32_t> flushedCtx_;                  // contexts flushed since their last put
  uint64_t held_ = 0, pending_ = 0, overtaken_ = 0;  // puts held; not fully landed; held and overtaken
  bool unrung_ = false;                              // a put was posted on a link that rang no doorbell yet
  // Scratch (taker only, reused so that a doorbell allocates nothing once warm).
  struct Signal {
    Pending* put;
    uint64_t at;  // spraying: its arrival
  };
  std::vector<Pending*> batch_, released_, now_, one_, blocked_;
  std::vector<Signal> signals_;
  std::vector<uint32_t> ready_, waiting_;
  std::vector<Landing> pool_;
  const uint32_t paths_;                 // spraying: the paths (1: none)
  std::vector<uint64_t> pathFree_;       // ... when each is free again, in the set being landed
  std::vector<uint64_t> pathLast_;       // ... and its last arrival (a path is FIFO)
  std::vector<uint64_t> pathLatencyNs_;  // ... each one's latency
  double pathNsPerByte_ = 0;             // ... and its time per byte
};

}  // namespace
