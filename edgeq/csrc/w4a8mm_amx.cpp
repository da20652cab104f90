// AMX-INT8 path of the W4A8 kernel (placeholder: runs the VNNI blocks).
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

#include "w4a8mm.h"

namespace edgeq_w4a8 {

void block_amx(const Args& a, int64_t nb, uint8_t* scratch) { block_vnni(a, nb, scratch); }

bool amx_usable() {
  // CPUID.(7,0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8; then ask Linux for the tile data state (process-wide).
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace edgeq_w4a8
