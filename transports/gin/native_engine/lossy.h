// The native engine's LOSSY link and the reliability layer above it (SRD-like), under
// the unordered wire: the same model as transports/gin/faults.py's ReliableWire, with
// draws of this file's own stream (seed, rank) and timers scaled to this engine.
//
//   unordered wire (unordered.h: what lands when) -> Lossy::send: sender half
//     -> lossy link (seeded drops, duplicates, delays)
//     -> receiver half (duplicate suppression, reorder buffer, acks)
//     -> the engine's network (shm_net.h, mpi_net.h): the landing happens
//
// - Packets: every landing the unordered wire decides (a data segment, a signal) is one
//   packet, numbered per (peer, ctx) from 0, in the order the wire decided it.
// - The lossy link: each transmission is dropped with probability drop; otherwise it
//   arrives once, and a second copy too with probability dup; each arriving copy is late
//   with probability delay, by a uniform 0..faultMaxDelayNs, so later packets overtake
//   it. The draws come from one stream seeded by (seed, rank), in the order of
//   faults.py (drop, dup, then delay per copy): a run's faults are a function of its seed
//   and of its sequence of transmissions.
// - Receiver: a copy whose number was delivered, or is already in the reorder buffer, is
//   a duplicate and is dropped (dupDropped): a signal never counts twice. The first copy
//   is acknowledged as it arrives (selectively, per packet; the ack is not lost) and
//   waits until every lower number of its link has been delivered; then the buffer
//   delivers in number order. So what lands is exactly the unordered wire's order per
//   link, and the trace (recorded as the wire decides) replays against the model.
// - Sender: a packet not acknowledged faultRetransmitNs after its last transmission is
//   sent again (retransmits); after faultTransmissions transmissions without an ack it
//   is undeliverable and the engine fails naming rank, peer, context and packet.
// - Bytes: a packet that is delivered as it is sent (nothing of its link outstanding,
//   the first copy neither dropped nor late) lands from its source; any other is copied
//   when sent, so the source is reusable at once (the wire bumps counters as it sends).
// The receiver's half lives beside the sender's (the taker is the only writer of its
// links); on network mpi the messages under it are MPI's, reliable and ordered.
// Liveness: while anything is outstanding the takers run progress() (the engine's thread
// polls, or sleeps no later than nextDueNs()), and every send runs what is due first;
// every outstanding packet is delivered or failed within faultTransmissions
// retransmission periods plus the largest delay.
#pragma once

#include <deque>
#include <map>
#include <queue>

#include "core.h"
#include "unordered.h"

namespace {

// Planted bug (native.py's PLANT_NO_DEDUP): a duplicate of a delivered packet lands again.
enum : uint64_t { kPlantNoDedup = 4 };
enum : uint64_t { kStreamFaults = 5 };

class Lossy {
 public:
  explicit Lossy(const CommrefGinEngineConfig& c)
      : cfg_(c),
        active_(c.faultDrop > 0 || c.faultDup > 0 || c.faultDelay > 0),
        rng_(c.seed, (uint64_t)c.rank, 0, 0, kStreamFaults << 48) {}

  bool active() const { return active_; }
  uint64_t outstanding() const { return outstanding_; }
  // When progress() has work next: a late copy's arrival or a timer (~0: none).
  uint64_t nextDueNs() const {
    const uint64_t timer = timers_.empty() ? ~0ull : timers_.front().dueNs;
    return arriving_.empty() ? timer : std::min(timer, arriving_.top().atNs);
  }

  // packets, dropped, duplicated, delayed, retransmits, dupDropped (faults.STATS' order)
  void stats(uint64_t* out) const {
    for (int i = 0; i < 6; i++) out[i] = stats_[i].load(std::memory_order_relaxed);
  }

  // Sends `p` over the lossy link; deliver(const Packet&) lands one packet. What is due
  // first arrives or is sent again (progress()), so that a long run of sends does not
  // leave a lost packet waiting for its timer. False on failure (a landing's message is
  // the engine's; an undeliverable packet's goes to fail).
  template <typename Deliver, typename Fail>
  bool send(Packet&& p, Deliver deliver, Fail fail) {
    const uint64_t now = nowNs();
    if (now >= nextDueNs() && !due(now, deliver, fail)) return false;
    Link& l = link(p.peer, p.ctx);
    const uint64_t seq = l.nextSeq++;
    bump(kPackets);
    const Draw d = draw();
    const bool plant = cfg_.plant & kPlantNoDedup;
    if (!plant && l.packets.empty() && d.copies > 0 && !d.late[0]) {  // delivered as sent, from its source
      l.nextDue = seq + 1;
      if (!deliver(p)) return false;
      if (d.copies == 2) arriveLater(l, seq, now, d, 1);
      return true;
    }
    if (p.src && p.nbytes) {
      p.bytes = spare();
      p.bytes.assign(p.src, p.src + p.nbytes);
    }
    p.src = nullptr;
    Entry& e = l.packets[seq];
    e.packet = std::move(p);
    e.transmissions = 1;
    timers_.push_back({now + cfg_.faultRetransmitNs, &l, seq, 1});
    outstanding_++;
    return transmit(l, seq, now, d, deliver);
  }

  // Copies due arrive, unacknowledged packets past their timer are sent again (every one
  // due, in the order their timers expire); false on failure (an undeliverable packet:
  // the message names it, through fail).
  template <typename Deliver, typename Fail>
  bool progress(Deliver deliver, Fail fail) {
    return (!outstanding_ && arriving_.empty()) || due(nowNs(), deliver, fail);
  }

 private:
  // progress() at `now`.
  template <typename Deliver, typename Fail>
  bool due(uint64_t now, Deliver deliver, Fail fail) {
    while (!arriving_.empty() && arriving_.top().atNs <= now) {
      const Arrival a = arriving_.top();
      arriving_.pop();
      if (!arrive(*a.link, a.seq, deliver)) return false;
    }
    while (!timers_.empty() && timers_.front().dueNs <= now) {
      const Timer t = timers_.front();
      timers_.pop_front();
      Link& l = *t.link;
      auto it = l.packets.find(t.seq);
      if (it == l.packets.end() || it->second.acked || it->second.transmissions != t.transmission) continue;
      Entry& e = it->second;
      if (e.transmissions >= cfg_.faultTransmissions)
        return fail("lossy GIN wire: packet " + std::to_string(t.seq) + " to peer " + std::to_string(l.peer) +
                    " on context " + std::to_string(l.ctx) + " is undeliverable (expected its acknowledgement, " +
                    "seen none after " + std::to_string(e.transmissions) + " transmissions; " +
                    std::to_string(l.packets.size()) + " packets of the link outstanding, the next due " +
                    std::to_string(l.nextDue) + ")");
      bump(kRetransmits);
      e.transmissions++;
      timers_.push_back({now + cfg_.faultRetransmitNs, &l, t.seq, e.transmissions});
      if (!transmit(l, t.seq, now, draw(), deliver)) return false;
    }
    return true;
  }

  enum { kPackets, kDropped, kDuplicated, kDelayed, kRetransmits, kDupDropped };
  struct Draw {
    int copies = 0;
    bool late[2] = {false, false};
    uint64_t delayNs[2] = {0, 0};
  };
  struct Entry {
    Packet packet;
    uint64_t transmissions = 0;
    bool acked = false;      // arrived: in the receiver's reorder buffer (or delivered, planted)
    bool delivered = false;  // planted only: kept after delivery
  };
  struct Link {
    int32_t peer = 0, ctx = 0;
    uint64_t nextSeq = 0, nextDue = 0;  // the sender's next number; the receiver's next to deliver
    std::map<uint64_t, Entry> packets;  // sent, not delivered (unacknowledged or buffered)
  };
  // A transmission's retransmission timer: the packet is sent again at dueNs unless it
  // was acknowledged (or sent again) first. One period for all: dues come in push order.
  struct Timer {
    uint64_t dueNs;
    Link* link;
    uint64_t seq, transmission;
  };
  struct Arrival {
    uint64_t atNs, tiebreak;
    Link* link;
    uint64_t seq;
    bool operator>(const Arrival& o) const { return atNs != o.atNs ? atNs > o.atNs : tiebreak > o.tiebreak; }
  };

  void bump(int k) { stats_[k].fetch_add(1, std::memory_order_relaxed); }

  // A buffer for a packet's copy: one a delivered packet left, or a new one.
  std::vector<char> spare() {
    if (spare_.empty()) return {};
    std::vector<char> b = std::move(spare_.back());
    spare_.pop_back();
    return b;
  }

  double uniform() { return (double)(rng_.next() >> 11) * (1.0 / 9007199254740992.0); }

  Draw draw() {
    Draw d;
    if (uniform() < cfg_.faultDrop) {
      bump(kDropped);
      return d;
    }
    d.copies = 1;
    if (uniform() < cfg_.faultDup) {
      bump(kDuplicated);
      d.copies = 2;
    }
    for (int i = 0; i < d.copies; i++)
      if (uniform() < cfg_.faultDelay) {
        bump(kDelayed);
        d.late[i] = true;
        d.delayNs[i] = (uint64_t)(uniform() * (double)cfg_.faultMaxDelayNs);
      }
    return d;
  }

  Link& link(int32_t peer, int32_t ctx) { return links_.at(peer, ctx); }

  void arriveLater(Link& l, uint64_t seq, uint64_t now, const Draw& d, int copy) {
    arriving_.push({now + (d.late[copy] ? d.delayNs[copy] : 0), tiebreak_++, &l, seq});
  }

  // The copies of one transmission of packet `seq` (drawn: d): each arrives now or later.
  template <typename Deliver>
  bool transmit(Link& l, uint64_t seq, uint64_t now, const Draw& d, Deliver deliver) {
    for (int i = 0; i < d.copies; i++) {
      if (d.late[i]) {
        arriveLater(l, seq, now, d, i);
      } else if (!arrive(l, seq, deliver)) {
        return false;
      }
    }
    return true;
  }

  // One copy of packet `seq` arrives at the receiver: dropped as a duplicate, or
  // acknowledged, buffered, and every packet now in order delivered.
  template <typename Deliver>
  bool arrive(Link& l, uint64_t seq, Deliver deliver) {
    auto it = l.packets.find(seq);
    if (seq < l.nextDue || it == l.packets.end() || it->second.acked) {
      bump(kDupDropped);
      if ((cfg_.plant & kPlantNoDedup) && it != l.packets.end() && it->second.delivered)
        return deliver(it->second.packet);  // planted: a duplicate lands again
      return true;
    }
    it->second.acked = true;  // the ack: never sent again
    for (auto due = l.packets.find(l.nextDue); due != l.packets.end() && due->second.acked;
         due = l.packets.find(l.nextDue)) {
      if (!due->second.delivered && !deliver(due->second.packet)) return false;
      l.nextDue++;
      if (cfg_.plant & kPlantNoDedup) {
        due->second.delivered = true;
        outstanding_--;
      } else {
        if (spare_.size() < kSpareBuffers) spare_.push_back(std::move(due->second.packet.bytes));
        l.packets.erase(due);
        outstanding_--;
      }
    }
    return true;
  }

  const CommrefGinEngineConfig& cfg_;
  const bool active_;
  Stream rng_;
  LinkMap<Link> links_;
  std::priority_queue<Arrival, std::vector<Arrival>, std::greater<Arrival>> arriving_;  // late copies
  std::deque<Timer> timers_;              // every transmission of a packet not yet acknowledged
  std::vector<std::vector<char>> spare_;  // delivered packets' copies, reused (at most kSpareBuffers)
  static constexpr size_t kSpareBuffers = 1024;
  uint64_t tiebreak_ = 0, outstanding_ = 0;
  std::atomic<uint64_t> stats_[6] = {};
};

}  // namespace
