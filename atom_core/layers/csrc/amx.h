// AMX tiles for the kernels built for AVX-512 BF16 (paged attention's bfloat16 pairs, the
// streaming GEMM's bfloat16 rows): Linux's permission, one tile configuration, and giving the
// tiles back. Each kernel module keeps its own switch (`on`, set by its `set_amx`), so a test can
// turn one off without the other; builds without AVX-512 BF16 get stubs that never tile.
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace atom::amx {

// A tile's rows (and a bfloat16 tile's pairs): palette 1's 16 rows of 64 bytes.
constexpr int64_t kRows = 16;

// Whether this module multiplies in tiles (its `set_amx`): off until asked, and only where
// the build, the CPU and Linux allow it.
inline std::atomic<bool> on{false};

inline int64_t padded_rows(int64_t rows) { return (rows + kRows - 1) / kRows * kRows; }

#if defined(__AVX512BF16__)
// Linux hands the tiles' register state to a process on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, as oneDNN asks too); without it the first tile
// instruction faults.
inline bool permitted() {
  static const bool permitted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}

// Whether this thread has configured the tiles since it last released them.
inline thread_local bool configured = false;

// Every tile 16 rows of 64 bytes (palette 1).
__attribute__((target("amx-tile"))) inline void configure() {
  configured = true;
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = kRows;
  // GCC's _tile_loadconfig names only a pointer's worth of cfg as read: the whole of it here
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

// The tiles back to their initial state, and ATen's record of which micro-kernel's
// configuration they hold dropped: its next brgemm call configures them again.
__attribute__((target("amx-tile"))) inline void release() {
  if (!configured) return;  // this thread never tiled
  configured = false;
  _tile_release();
  at::native::cpublas::brgemm_release(true);
}
#else
inline bool permitted() { return false; }
inline void configure() {}
inline void release() {}
#endif

// The module's `set_amx(on)`: tiles on where this build, the CPU and Linux allow them; returns
// whether they are on.
inline bool set(bool want) {
  on.store(want && permitted());
  return on.load();
}

}  // namespace atom::amx
