// The native engine's ORDERED wire with independent contexts (GinOptions.independent_contexts):
// contexts are separate ordering domains, as queue pairs on InfiniBand RC are; each
// (peer, ctx) link stays FIFO while a seeded adversary holds one context's traffic back
// and lets the peer's other contexts overtake it. The rules of transports/gin/scheduler.py
// ("independent contexts"), with this engine's streams (unordered.h's Stream):
//   1. an op posted on a link that holds nothing, to a peer posted on another context
//      before, draws from a stream of its own (seed, rank, peer, ctx, seq): with
//      probability 1/4 the link is held: the op's first k segments land (k from 0 up to
//      its segments minus one), the rest of it and every later op of the link wait in
//      the link's FIFO;
//   2. the link is released, its FIFO landing in posted order, when 1..4 (drawn with the
//      hold) later ops to that peer on other contexts have landed past it (expired), when
//      a get is posted on it (forced: it reads after the context's earlier puts), or when
//      the takers found the queue empty (idle: UnorderedWire's liveness rule, counted
//      polls, not a timer). A flush stages the sources of what waits (they are reusable
//      when it returns) but releases nothing: it promises reusable sources, not remote
//      visibility.
#pragma once

#include "unordered.h"

namespace {

constexpr uint32_t kContextHoldOneIn = 4;  // scheduler.CONTEXT_HOLD_PROBABILITY
constexpr uint64_t kContextHoldOps = 4;    // scheduler.CONTEXT_HOLD_OPS

class IndependentContexts {
 public:
  explicit IndependentContexts(const CommrefGinEngineConfig& c)
      : cfg_(c), sb_(c.segmentBytes ? c.segmentBytes : 4096) {}

  struct Link {
    std::deque<Pending> queued;  // the held FIFO (its head may be cut: some segments landed)
    uint64_t holdFor = 0;        // landings of the peer's other contexts that release it
    int32_t peer = 0, ctx = 0;
  };

  uint64_t held() const { return held_; }
  uint64_t pending() const { return pending_; }

  // Takes op `p` (seq and fields filled): queues it behind a held link, holds the link at
  // it (landing its first segments by seg(p, k)), or lands it whole (whole(p)) and counts
  // it against the holds of the peer's other contexts. hold(p, ops) and release(p, why)
  // record. False on a landing's error.
  template <typename Whole, typename Seg, typename Hold, typename Release>
  bool post(Pending&& p, Whole whole, Seg seg, Hold hold, Release release) {
    Link& l = link(p.peer, p.ctx);
    if (!l.queued.empty()) {
      hold(p, l.holdFor);
      pushQueued(l, std::move(p));
      return true;
    }
    bool others = false;
    for (auto& kv : links_)
      if (kv.second.peer == p.peer && kv.second.ctx != p.ctx) others = true;
    if (others) {
      Stream rng(cfg_.seed, (uint64_t)cfg_.rank, (uint64_t)p.peer, (uint64_t)p.ctx, (kStreamContext << 48) | p.seq);
      if (rng.below(kContextHoldOneIn) == 0) {
        const uint64_t nseg = p.nseg(sb_);
        const uint64_t cut = nseg ? rng.below(nseg) : 0;
        l.holdFor = 1 + rng.below(kContextHoldOps);
        hold(p, l.holdFor);
        p.landed.assign(nseg, 0);
        p.dataLeft = nseg;
        Pending& q = pushQueued(l, std::move(p));
        held_++;
        for (uint64_t k = 0; k < cut; k++)
          if (!seg(q, k)) return false;
        return true;
      }
    }
    if (!whole(p)) return false;
    return landedPast(p.peer, p.ctx, whole, seg, release);
  }

  // A get on (peer, ctx): what the link holds lands first.
  template <typename Whole, typename Seg, typename Release>
  bool forced(int32_t peer, int32_t ctx, Whole whole, Seg seg, Release release) {
    Link* l = links_.find(peer, ctx);
    return l == nullptr || l->queued.empty() || releaseLink(*l, 1, whole, seg, release);
  }

  // The takers found the queue empty: every held link lands, in an order drawn from the
  // idle stream.
  template <typename Whole, typename Seg, typename Release>
  bool releaseIdle(Whole whole, Seg seg, Release release) {
    std::vector<Link*> heldLinks;
    for (auto& kv : links_)
      if (!kv.second.queued.empty()) heldLinks.push_back(&kv.second);
    Stream rng(cfg_.seed, (uint64_t)cfg_.rank, 0, 0, (kStreamContext << 48) | ++idleReleases_);
    for (size_t i = heldLinks.size(); i > 1; i--) std::swap(heldLinks[i - 1], heldLinks[rng.below(i)]);
    for (Link* l : heldLinks)
      if (!releaseLink(*l, 2, whole, seg, release)) return false;
    return true;
  }

  // A flush of `ctx`: the sources of what waits on its links are staged.
  template <typename Stage>
  void flush(int32_t ctx, Stage stage) {
    for (auto& kv : links_)
      if (kv.second.ctx == ctx)
        for (Pending& p : kv.second.queued) stage(p);
  }

 private:
  Link& link(int32_t peer, int32_t ctx) { return links_.at(peer, ctx); }

  Pending& pushQueued(Link& l, Pending&& p) {
    if (p.landed.empty()) {
      p.landed.assign(p.nseg(sb_), 0);
      p.dataLeft = p.landed.size();
    }
    l.queued.push_back(std::move(p));
    pending_++;
    return l.queued.back();
  }

  // Op of (peer, ctx) landed: each held link of the peer's other contexts counts it.
  template <typename Whole, typename Seg, typename Release>
  bool landedPast(int32_t peer, int32_t ctx, Whole whole, Seg seg, Release release) {
    for (auto& kv : links_) {
      Link& o = kv.second;
      if (o.peer != peer || o.ctx == ctx || o.queued.empty()) continue;
      if (--o.holdFor == 0 && !releaseLink(o, 0, whole, seg, release)) return false;
    }
    return true;
  }

  // Lands a held link's FIFO in posted order (the cut head's remaining segments, then its
  // signal; later ops whole). why: 0 expired, 1 forced, 2 idle (UnorderedWire's kRelease* order).
  template <typename Whole, typename Seg, typename Release>
  bool releaseLink(Link& l, uint32_t why, Whole whole, Seg seg, Release release) {
    held_--;
    while (!l.queued.empty()) {
      Pending& p = l.queued.front();
      release(p, why);
      bool cut = false;
      for (uint8_t c : p.landed) cut = cut || c;
      if (cut) {
        for (uint64_t k = 0; k < p.landed.size(); k++)
          if (!p.landed[k] && !seg(p, k)) return false;
        if (!whole(p)) return false;  // the signal alone: the data has landed
      } else if (!whole(p)) {
        return false;
      }
      l.queued.pop_front();
      pending_--;
    }
    return true;
  }

  const CommrefGinEngineConfig& cfg_;
  const uint64_t sb_;
  LinkMap<Link> links_;
  uint64_t held_ = 0, pending_ = 0, idleReleases_ = 0;
};

}  // namespace
