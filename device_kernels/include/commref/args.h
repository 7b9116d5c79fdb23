// commref/args.h — the launch ABI: plain structs passed to kernels by value.
//
// Every field is a fixed-width integer so that the host side can describe the same
// layout with a numpy structured dtype (device_kernels/abi.py); a unit test checks
// sizes and offsets against commref_abi_layout() from the CPU build.
// Pointers travel as uint64_t device addresses.
#pragma once
#include "port.h"

#define COMMREF_MAX_CHANNELS 16
#define COMMREF_CONN_IN 4   // inbound FIFOs per channel: ring-from-prev, tree-from-child0/1, tree-from-parent
#define COMMREF_CONN_OUT 4  // outbound links per channel: ring-to-next, tree-to-parent, tree-to-child0/1

enum ConnIn { kInRing = 0, kInTreeChild0 = 1, kInTreeChild1 = 2, kInTreeParent = 3 };
enum ConnOut { kOutRing = 0, kOutTreeParent = 1, kOutTreeChild0 = 2, kOutTreeChild1 = 3 };

// Where each piece of connection state lives inside every rank's connection window.
// The layout is symmetric: the same offsets on every rank.
//   fifo[c][k]      nsteps slots of slotBytes    written by the sender of inbound k
//   ready[c][k]     uint64 steps posted          written by that sender (release)
//   header[c][k][s] 2 x uint64 call descriptor   written by that sender, per step
//   credit[c][j]    uint64 steps consumed        written by the receiver of outbound j
//   stepState       uint64 per (c, k) and (c, j) this rank's own persistent step counters
// Flag words are 64 bytes apart so that two writers never share a cache line.
struct WindowLayout {
  uint64_t fifoOff, readyOff, headerOff, creditOff, stateOff;
  uint64_t slotBytes;
  uint32_t nsteps, flagStride;
};

// The neighbours of this rank in channel c (-1 where there is none).
struct ChannelPeers {
  int32_t ringPrev, ringNext;
  int32_t treeParent, treeChild0, treeChild1;
  int32_t treeInAtParent;  // which inbound FIFO of the parent this rank feeds (1 or 2)
  int32_t treeOutAtParent; // which outbound link of the parent feeds this rank (2 or 3)
  int32_t pad;
};

// The first failure of a kernel, in host-visible memory: the launcher turns it into
// an exception naming rank, peer, what was awaited, expected vs seen.
enum ErrorCode : uint32_t { kOk = 0, kTimeout = 1, kMismatch = 2, kAborted = 3 };
enum WaitWhat : uint32_t {
  kWaitRecvReady = 1,   // data of a step from the sending peer
  kWaitSendCredit = 2,  // the receiving peer to free a FIFO slot
  kCallMismatch = 3,    // the peer's call descriptor (collective, algorithm, dtype, op, root) differs
  kCountMismatch = 4    // the peer's element count differs
};
struct ErrorRecord {
  uint32_t code, what;
  int32_t rank, peer, channel, pad;
  uint64_t expected, seen;
};

struct CollArgs {
  uint64_t sendbuf, recvbuf;  // device addresses
  uint64_t count;             // elements (bytes for kernels that only move data), see each kernel
  uint64_t peerWindows;       // -> uint64_t[nranks]: each rank's connection window, mapped here
  uint64_t errorRecord;       // -> ErrorRecord
  uint64_t abortFlag;         // -> uint64_t; nonzero when the job is being torn down
  uint64_t callDesc;          // packed (collective, algorithm, dtype, op, root); must match on all ranks
  int64_t timeoutNs;          // deadline of every wait
  WindowLayout layout;
  int32_t rank, nranks, root, dtype, op, nchannels, elemSize, pad;
  ChannelPeers peers[COMMREF_MAX_CHANNELS];
};

struct CopyArgs {  // engine self-test and benchmark kernels
  uint64_t src, dst, bytes;
};
