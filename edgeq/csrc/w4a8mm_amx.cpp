// AMX-INT8 path of the W4A8 kernel (prefill, M > 8; the binding keeps decode on the VNNI path, which is memory-bound).
//
// The column block is unpacked once into scratch as q - z int8 (w4a8mm_avx512.h: per input quad kg, 64 bytes of lo
// lanes then 64 of hi lanes), which is already AMX's B layout: a B tile of kc/4 rows x 64 bytes, row r = quad kg0 + r
// = 16 lanes x 4 consecutive k, taken with a 128-byte stride for the lo lanes and the same from +64 for the hi
// lanes. An A tile is up to 16 rows x kc bytes of (q_a + 128) straight from the quantised activations (stride K);
// tdpbusd sums u8 x s8 products into int32 exactly like vpdpbusd (kc = min(bk, 64) per step, bk / kc steps per K
// block; two A tiles (32 rows) per B tile pair). After each K block the C tiles (16 rows x 16 lanes int32, lo and
// hi, per 16-row tile) are stored and the same fp32
// epilogue as the VNNI path runs row by row (accumulate_row: acc - 128 comp, one rounded multiply by s_a, one fma
// with s_w into the fp32 row), so the bits are those of the VNNI and portable paths.
// Tiles: see configure(). The configuration is loaded per column block and released after
// it, so other AMX users on the thread (oneDNN) find the tiles as they expect.
#include <immintrin.h>

#include <cstring>

#include "amx_os.h"
#include "w4a8mm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")

#include "w4a8mm_avx512.h"

namespace edgeq_w4a8 {
namespace {

// Two 16-row M tiles share each B tile: C tiles 0, 1 (rows m0.., lo / hi), 2, 3 (rows m0+16.., lo / hi); A tiles 4, 5;
// B tiles 6 (lo), 7 (hi). mt1 = 0 leaves the second M tile out.
void configure(int mt0, int mt1, int kc) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  const int rows[2] = {mt0, mt1};
  for (int i = 0; i < 2; ++i) {
    if (!rows[i]) continue;
    const auto r = static_cast<uint8_t>(rows[i]);
    cfg.rows[2 * i] = cfg.rows[2 * i + 1] = r, cfg.colsb[2 * i] = cfg.colsb[2 * i + 1] = 64;  // C: r x 16 int32
    cfg.rows[4 + i] = r, cfg.colsb[4 + i] = static_cast<uint16_t>(kc);                        // A: r x kc u8
  }
  for (int t = 6; t < 8; ++t) cfg.rows[t] = static_cast<uint8_t>(kc / 4), cfg.colsb[t] = 64;  // B: kc/4 x 64 s8
  load_tile_config(cfg);
}

template <bool TWO>
inline void k_block(const Args& a, const int8_t* wk, int64_t m0, int64_t kb, int kc) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t K = a.K;
  for (int64_t k = 0; k < a.bk; k += kc) {
    const uint8_t* x = a.au8 + m0 * K + kb * a.bk + k;
    _tile_loadd(6, wk + (k / 4) * 128, 128);
    _tile_loadd(7, wk + (k / 4) * 128 + 64, 128);
    _tile_loadd(4, x, K);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, x + 16 * K, K);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    }
  }
}

}  // namespace

void block_amx(const Args& a, int64_t nb, uint8_t* scratch) {
  const int64_t M = a.M, K = a.K, bk = a.bk, KB = a.kblocks(), slot_bytes = a.slot_bytes();
  int8_t* w = reinterpret_cast<int8_t*>(scratch);
  float* C = reinterpret_cast<float*>(scratch + ((K * 32 + 63) & ~63));  // 32 rows x 32 fp32, lane order
  int32_t* cb = reinterpret_cast<int32_t*>(C + 32 * 32);                 // C tiles [4][16][16]
  unpack_column_block(a, nb, w);
  const int kc = static_cast<int>(bk < 64 ? bk : 64);
  int configured = -1;
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int rows = static_cast<int>(M - m0 < 32 ? M - m0 : 32);
    const int mt0 = rows < 16 ? rows : 16, mt1 = rows - mt0;
    if (rows != configured) configure(mt0, mt1, kc), configured = rows;
    init_c(a, nb, C, rows);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const int8_t* wk = w + kb * bk * 32;
      if (mt1) {
        k_block<true>(a, wk, m0, kb, kc);
        _tile_stored(2, cb + 512, 64);
        _tile_stored(3, cb + 768, 64);
      } else {
        k_block<false>(a, wk, m0, kb, kc);
      }
      _tile_stored(0, cb, 64);
      _tile_stored(1, cb + 256, 64);
      __m512i clo, chi;
      comp128(a, a.qw + (nb * KB + kb) * slot_bytes, clo, chi);
      __m512 slo, shi;
      load_lanes_ps(a.scales + (nb * KB + kb) * kBlockN, slo, shi);
      for (int m = 0; m < rows; ++m) {
        const int32_t* t = cb + (m >> 4) * 512 + (m & 15) * 16;  // tile pair of the row, then its row
        accumulate_row(_mm512_load_si512(t), _mm512_load_si512(t + 256), clo, chi, a.sa[m0 + m], slo, shi,
                       C + m * 32);
      }
    }
    store_c(a, nb, C, m0, rows);
  }
  _tile_release();
}

}  // namespace edgeq_w4a8

#pragma GCC pop_options

namespace edgeq_w4a8 {

bool amx_usable() { return amx_granted(25); }  // AMX-TILE + AMX-INT8

}  // namespace edgeq_w4a8
