#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <immintrin.h>
struct tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
int main(void) {
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, as ggml_amx_init asks: refused means llama.cpp turns its
       AMX buffers off by itself. */
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    config.colsb[0] = 64;
    config.rows[0] = 16;
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_release();
    return 0;
}
