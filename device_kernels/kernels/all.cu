// The one translation unit the loader compiles, for the GPU (NVRTC) and the CPU.
#include "ring.cu"
#include "tree.cu"
#include "direct.cu"
#include "selftest.cu"

#ifdef COMMREF_CPU
#include <stddef.h>
// Sizes and offsets of the launch ABI, checked against device_kernels/abi.py.
#define COMMREF_ABI_FIELDS(X)                                                              \
  X(CollArgs, sendbuf) X(CollArgs, recvbuf) X(CollArgs, count) X(CollArgs, peerWindows)    \
  X(CollArgs, errorRecord) X(CollArgs, abortFlag) X(CollArgs, callDesc) X(CollArgs, timeoutNs) \
  X(CollArgs, layout) X(CollArgs, rank) X(CollArgs, nranks) X(CollArgs, root) X(CollArgs, dtype) \
  X(CollArgs, op) X(CollArgs, nchannels) X(CollArgs, elemSize) X(CollArgs, streamStores) X(CollArgs, gin) X(CollArgs, symSend) X(CollArgs, symRecv) X(CollArgs, peers) \
  X(WindowLayout, fifoOff) X(WindowLayout, readyOff) X(WindowLayout, creditOff)            \
  X(WindowLayout, stateOff) X(WindowLayout, stagingOff) X(WindowLayout, ginQueueOff)       \
  X(WindowLayout, ginSignalsOff) X(WindowLayout, ginCountersOff) X(WindowLayout, syncOff) X(WindowLayout, slotBytes) \
  X(WindowLayout, nsteps) X(WindowLayout, flagStride)                                      \
  X(GinArgs, peerMask) X(GinArgs, capacity) X(GinArgs, protocol) X(GinArgs, putsPerSlot)  \
  X(GinArgs, checkHeaders) X(GinArgs, creditSignalBase) X(GinDescriptor, seq) X(GinDescriptor, op) X(GinDescriptor, flags) \
  X(GinDescriptor, peer) X(GinDescriptor, ctx) X(GinDescriptor, dstOffset) X(GinDescriptor, srcOffset) \
  X(GinDescriptor, bytes) X(GinDescriptor, signal) X(GinDescriptor, signalValue) X(GinDescriptor, counter) \
  X(ChannelPeers, ringPrev) X(ChannelPeers, treeInAtParent) X(ChannelPeers, treeOutAtParent) \
  X(ErrorRecord, code) X(ErrorRecord, what) X(ErrorRecord, rank) X(ErrorRecord, peer)      \
  X(ErrorRecord, channel) X(ErrorRecord, expected) X(ErrorRecord, seen) X(SymBuffer, offset)
#define COMMREF_ABI_NAME(S, f) #S "." #f ":"
#define COMMREF_ABI_OFFSET(S, f) (uint64_t) offsetof(S, f),
extern "C" __attribute__((visibility("default"))) const char* commref_abi_names() {
  return COMMREF_ABI_FIELDS(COMMREF_ABI_NAME) "CollArgs:ChannelPeers:WindowLayout:ErrorRecord:CopyArgs:GinArgs:GinDescriptor:SymBuffer";
}
extern "C" __attribute__((visibility("default"))) const uint64_t* commref_abi_values() {
  static const uint64_t v[] = {COMMREF_ABI_FIELDS(COMMREF_ABI_OFFSET) sizeof(CollArgs), sizeof(ChannelPeers),
                               sizeof(WindowLayout), sizeof(ErrorRecord), sizeof(CopyArgs), sizeof(GinArgs),
                               sizeof(GinDescriptor), sizeof(SymBuffer)};
  return v;
}
#endif
