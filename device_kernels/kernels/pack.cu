// A packed group's copies (collectives/packing.py): before its one collective, each
// member's input into the packed send buffer; after it, each member's part of the packed
// result into the member's output, unless the result's flag element says that some rank
// could not pack (it then runs its members one by one, and every rank does the same).
#include "commref/ring.h"

// The library's kernels are commref's own code; COMMREF_KERNEL gives each C linkage, so
// its symbol is its name (the loader looks kernels up by abi.ENGINE_KERNELS).
namespace commref {

// Block b takes copies b, b + grid, ...; the threads of a block split each copy.
COMMREF_KERNEL(commref_pack, PackArgs, args) {
  if (args.flagBytes) {
    const unsigned char* flag = (const unsigned char*)args.flag;
    for (uint32_t i = 0; i < args.flagBytes; i++)
      if (flag[i] != (unsigned char)(args.clear >> (8 * i))) return;
  }
  const CopyArgs* copies = (const CopyArgs*)args.copies;
  for (uint32_t i = blockIdx.x; i < args.n; i += gridDim.x)
    copyOwnShare<uint8_t>((uint8_t*)copies[i].dst, (const uint8_t*)copies[i].src, copies[i].bytes);
}

}  // namespace commref
