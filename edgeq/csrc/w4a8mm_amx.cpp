// AMX-INT8 path of the W4A8 kernel (prefill, M > 8; the binding keeps decode on the VNNI path, which is memory-bound).
//
// The column block is unpacked once into scratch as q - z int8 (w4a8mm_avx512.h: per input quad kg, 64 bytes of lo
// lanes then 64 of hi lanes), which is already AMX's B layout: a B tile of kc/4 rows x 64 bytes, row r = quad kg0 + r
// = 16 lanes x 4 consecutive k, taken with a 128-byte stride for the lo lanes and the same from +64 for the hi
// lanes. The A tile is up to 16 rows x kc bytes of (q_a + 128) straight from the quantised activations (stride K);
// tdpbusd sums u8 x s8 products into int32 exactly like vpdpbusd (kc = min(bk, 64) per step, bk / kc steps per K
// block). After each K block the two C tiles (16 rows x 16 lanes int32, lo and hi) are stored and the same fp32
// epilogue as the VNNI path runs row by row (accumulate_row: acc - 128 comp, one rounded multiply by s_a, one fma
// with s_w into the fp32 row), so the bits are those of the VNNI and portable paths.
// Tiles: 0, 1 C (lo, hi); 2 A; 3, 4 B (lo, hi). The configuration is loaded per column block and released after
// it, so other AMX users on the thread (oneDNN) find the tiles as they expect.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>
#include <cstring>

#include "w4a8mm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")

#include "w4a8mm_avx512.h"

namespace edgeq_w4a8 {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure(int mt, int kc) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 2; ++t) cfg.rows[t] = static_cast<uint8_t>(mt), cfg.colsb[t] = 64;  // C: mt x 16 int32
  cfg.rows[2] = static_cast<uint8_t>(mt), cfg.colsb[2] = static_cast<uint16_t>(kc);       // A: mt x kc u8
  for (int t = 3; t < 5; ++t) cfg.rows[t] = static_cast<uint8_t>(kc / 4), cfg.colsb[t] = 64;  // B: kc/4 x 64 s8
  _tile_loadconfig(&cfg);
}

}  // namespace

void block_amx(const Args& a, int64_t nb, uint8_t* scratch) {
  const int64_t M = a.M, K = a.K, bk = a.bk, KB = a.kblocks(), slot_bytes = a.slot_bytes();
  int8_t* w = reinterpret_cast<int8_t*>(scratch);
  float* C = reinterpret_cast<float*>(scratch + ((K * 32 + 63) & ~63));  // 16 rows x 32 fp32, lane order
  int32_t* cb = reinterpret_cast<int32_t*>(C + 16 * 32);                 // C tiles: lo [16][16], hi [16][16]
  unpack_column_block(a, nb, w);
  const int kc = static_cast<int>(bk < 64 ? bk : 64);
  int configured = -1;
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int mt = static_cast<int>(M - m0 < 16 ? M - m0 : 16);
    if (mt != configured) configure(mt, kc), configured = mt;
    init_c(a, nb, C, mt);
    for (int64_t kb = 0; kb < KB; ++kb) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t k = 0; k < bk; k += kc) {
        const int8_t* wk = w + kb * bk * 32 + (k / 4) * 128;
        _tile_loadd(2, a.au8 + m0 * K + kb * bk + k, K);
        _tile_loadd(3, wk, 128);
        _tile_loadd(4, wk + 64, 128);
        _tile_dpbusd(0, 2, 3);
        _tile_dpbusd(1, 2, 4);
      }
      _tile_stored(0, cb, 64);
      _tile_stored(1, cb + 256, 64);
      __m512i clo, chi;
      comp128(a, a.qw + (nb * KB + kb) * slot_bytes, clo, chi);
      __m512 slo, shi;
      load_lanes_ps(a.scales + (nb * KB + kb) * kBlockN, slo, shi);
      for (int m = 0; m < mt; ++m)
        accumulate_row(_mm512_load_si512(cb + m * 16), _mm512_load_si512(cb + 256 + m * 16), clo, chi,
                       a.sa[m0 + m], slo, shi, C + m * 32);
    }
    store_c(a, nb, C, m0, mt);
  }
  _tile_release();
}

}  // namespace edgeq_w4a8

#pragma GCC pop_options

namespace edgeq_w4a8 {

bool amx_usable() {
  // CPUID.(7,0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8; then ask Linux for the tile data state (process-wide).
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace edgeq_w4a8
