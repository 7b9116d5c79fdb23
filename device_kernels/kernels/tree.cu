// Tree AllReduce over a double binary tree: channel c uses tree c % 2 (the host
// builds both over the nodes, a chain inside each node, so that most nodes are a leaf
// in one and inner in the other: collectives/topology.py). Any tree of at most two
// children per rank works here.
// Pass 1 reduces every piece up to the root, pass 2 broadcasts it down; each pass
// pipelines pieces through the FIFOs.
#include "commref/ring.h"

// The library's kernels are commref's own code; COMMREF_KERNEL gives each C linkage, so
// its symbol is its name (the loader looks kernels up by abi.KERNEL_NAMES).
namespace commref {

template <typename T, typename Op>
static __device__ void treeAllReduce(const CollArgs& a) {
  const int c = blockIdx.x;
  const ChannelPeers& cp = a.peers[c];
  const T* src = (const T*)a.sendbuf;
  T* dst = (T*)a.recvbuf;
  const Share share = channelShare(a.count, c, a.nchannels);
  const bool hasParent = cp.treeParent >= 0, hasChildren = cp.treeChild0 >= 0;
  Prims<T, Op> up(a, c), down(a, c);
  if (cp.treeChild0 >= 0) up.addRecv(kInTreeChild0, cp.treeChild0, kOutTreeParent);
  if (cp.treeChild1 >= 0) up.addRecv(kInTreeChild1, cp.treeChild1, kOutTreeParent);
  if (hasParent) up.addSend(kOutTreeParent, cp.treeParent, cp.treeInAtParent);
  if (hasParent) down.addRecv(kInTreeParent, cp.treeParent, cp.treeOutAtParent);
  if (cp.treeChild0 >= 0) down.addSend(kOutTreeChild0, cp.treeChild0, kInTreeParent);
  if (cp.treeChild1 >= 0) down.addSend(kOutTreeChild1, cp.treeChild1, kInTreeParent);
  if (!hasParent && !hasChildren) {  // a single rank
    up.copy(src + share.begin, dst + share.begin, share.end - share.begin, true);
    return;
  }
  ringHandshake<T, Op>(a, c);  // a rank running another algorithm: CommMismatch, not a timeout
  FOR_EACH_PIECE(base, len, share, up.slotElems()) {
    if (!hasChildren)
      up.send(src + base, len);
    else if (hasParent)
      up.recvReduceSend(src + base, len);
    else
      up.recvReduceCopy(src + base, dst + base, len, true);
  }
  FOR_EACH_PIECE(base, len, share, down.slotElems()) {
    if (!hasParent)
      down.copySend(dst + base, dst + base, len);
    else if (hasChildren)
      down.recvCopySend(dst + base, len);
    else
      down.recv(dst + base, len);
  }
  up.finish();
  down.finish();
}

#define TREE_ALLREDUCE(T, Op) treeAllReduce<T, Op>(args)
COMMREF_KERNEL(commref_tree_allreduce, CollArgs, args) { COMMREF_DISPATCH_REDUCTION(args, TREE_ALLREDUCE) }

}  // namespace commref
