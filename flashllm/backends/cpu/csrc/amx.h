/* What the greedy screen's two AMX paths (greedy_screen.c, greedy_screen_int8.c) share: whether the
 * CPU and the kernel let this process use the tiles, and the tile shape both load. */
#ifndef FLASHLLM_AMX_H
#define FLASHLLM_AMX_H

#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12)
#define FLASHLLM_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Every bit of `edx_bits` set in CPUID leaf 7's EDX (22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8), and the
 * kernel's permission for this process to use tile data (asked when the library loads). */
static inline int flashllm_amx_usable(unsigned edx_bits) {
    unsigned a, b, c, d;
    const int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & edx_bits) == edx_bits;
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): refused by kernels before 5.16 */
    return ok && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* Configures tiles 0..count-1 as 16 rows x 64 bytes (palette 1). */
__attribute__((target("amx-tile"))) static inline void flashllm_tiles_16x64(int count) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int i = 0; i < count; i++) config.rows[i] = 16, config.colsb[i] = 64;
    _tile_loadconfig(&config);
}
#endif

#endif
