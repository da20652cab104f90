// AMX availability and the tile configuration layout, shared by both native kernels (int4mm_amx.cpp: AMX-BF16,
// w4a8mm_amx.cpp: AMX-INT8).
// Include before any `#pragma GCC target`: the function is plain x86-64 code, and `static` keeps one private copy
// per translation unit (no inline symbol for the linker to pick from a target-specific unit).
#pragma once
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

// The 64-byte operand of ldtilecfg (palette 1): per tile, rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// ldtilecfg of all 64 bytes of `cfg`. Not `_tile_loadconfig`: gcc 12's header declares its operand as 8 bytes
// (`"m" (*(const void **) p)`), so the optimiser may drop the stores to the other 56 (the rows and bytes per row) as
// dead. llama.cpp's AMX path built with gcc 12 on an AMX machine loads a configuration whose rows were never stored
// and faults (SIGSEGV in ggml_backend_amx_mul_mat; docs/kernel.md, "llama.cpp's AMX path and gcc 12"). Ours kept the
// stores, by the optimiser's choice only; this operand names the whole object, so they cannot be dropped.
static inline void load_tile_config(const TileConfig& cfg) { asm volatile("ldtilecfg %0" : : "m"(cfg)); }

// CPUID.(7,0):EDX bit 24 AMX-TILE and `type_bit` (22 AMX-BF16, 25 AMX-INT8); then ask Linux for the tile data state
// (process-wide; asking again is harmless).
static inline bool amx_granted(int type_bit) {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 24) & 1) || !((edx >> type_bit) & 1)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
