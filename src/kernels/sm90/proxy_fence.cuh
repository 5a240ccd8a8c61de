// Proxy fences: TMA and wgmma read shared memory through the async proxy, ordinary stores write it
// through the generic proxy. A thread that wrote shared memory which TMA or wgmma reads next must
// fence before the barrier that publishes it (PTX ISA, "Memory consistency model", proxies).
#pragma once

#include <cuda/ptx>

namespace flamia::sm90 {

// Makes this thread's generic-proxy writes to shared memory visible to later async-proxy reads.
__device__ __forceinline__ void fence_async_shared() {
  ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_shared);
}

}  // namespace flamia::sm90
