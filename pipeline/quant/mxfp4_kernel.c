/* MXFP4 encoding of Quark 0.13's file-to-file weight quantizer ("even" scales), as a C loop.

   pipeline/quant/encoder.py compiles this file on first use and calls it through ctypes (the GIL is
   released, so threads split the rows). It is used only where pipeline/quant/proof.py has shown it
   bit-identical to Quark's routine over every input of the run's dtype; pipeline/quant/mxfp4.py is the
   layout's specification.

   Per block of 32 inputs:
     amax  = the largest magnitude (for non-negative IEEE floats, bit order is value order);
     e     = Quark's even_round: add half an ulp at mantissa bit 22, keep the exponent field, minus
             127 + 2, clamped to [-127, 127] (a zero or subnormal amax gives -127);
     y     = |x| * 2^-e: exact multiplication by a power of two, the same correctly rounded value as
             Quark's x / 2^e (2^-127 is the float32 subnormal 0x00400000);
     code  = nearest e2m1 value, ties to the even code, saturated at 6: the count of rounding
             boundaries 0.25 0.75 1.25 1.75 2.5 3.5 5 that y passes (">" at an even code, ">=" at odd);
     nibble = code, with the sign bit 8 for a negative input that did not round to zero;
     scale byte = max(e, -126) + 127 (Quark's e8m0 writer clamps the stored scale at 2^-126).
   Element 2i goes to the low nibble, 2i+1 to the high one. A block with an inf or NaN is refused:
   the functions return -1 and write nothing meaningful. */

#include <stdint.h>
#include <string.h>

#define GROUP 32

static inline int shared_exponent(uint32_t amax_bits) {
    uint32_t field = ((amax_bits + (1u << 21)) >> 23) & 0xFFu;
    if (field == 0) return -127;
    if (field == 0xFF) return 127;
    int e = (int)field - 129;
    return e < -127 ? -127 : e;
}

static inline float inverse_scale(int e) {
    uint32_t bits = e == 127 ? 0x00400000u : (uint32_t)(127 - e) << 23;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint8_t nibble(uint32_t bits, float inv) {
    uint32_t magnitude_bits = bits & 0x7FFFFFFFu;
    float magnitude;
    memcpy(&magnitude, &magnitude_bits, sizeof magnitude);
    float y = magnitude * inv;
    uint8_t code = (uint8_t)((y > 0.25f) + (y >= 0.75f) + (y > 1.25f) + (y >= 1.75f) + (y > 2.5f)
                             + (y >= 3.5f) + (y > 5.0f));
    return (uint8_t)(code | ((code != 0) & (bits >> 31)) << 3);
}

static inline int encode_block(const uint32_t *bits, uint8_t *packed, uint8_t *scale) {
    uint32_t amax = 0;
    for (int i = 0; i < GROUP; i++) {
        uint32_t magnitude = bits[i] & 0x7FFFFFFFu;
        amax = magnitude > amax ? magnitude : amax;
    }
    if (amax >= 0x7F800000u) return -1;
    int e = shared_exponent(amax);
    float inv = inverse_scale(e);
    for (int i = 0; i < GROUP / 2; i++)
        packed[i] = (uint8_t)(nibble(bits[2 * i], inv) | nibble(bits[2 * i + 1], inv) << 4);
    *scale = (uint8_t)((e < -126 ? -126 : e) + 127);
    return 0;
}

/* bfloat16 inputs (as uint16 patterns): `blocks` blocks of 32. */
int mxfp4_encode_bf16(const uint16_t *x, int64_t blocks, uint8_t *packed, uint8_t *scales) {
    uint32_t bits[GROUP];
    for (int64_t b = 0; b < blocks; b++) {
        for (int i = 0; i < GROUP; i++) bits[i] = (uint32_t)x[b * GROUP + i] << 16;
        if (encode_block(bits, packed + b * (GROUP / 2), scales + b)) return -1;
    }
    return 0;
}

/* float32 inputs (as uint32 patterns): `blocks` blocks of 32. */
int mxfp4_encode_f32(const uint32_t *x, int64_t blocks, uint8_t *packed, uint8_t *scales) {
    for (int64_t b = 0; b < blocks; b++)
        if (encode_block(x + b * GROUP, packed + b * (GROUP / 2), scales + b)) return -1;
    return 0;
}

/* An FP8 block-scaled weight, dequantized as pipeline/checkpoints/fp8.py does (float32 of the e4m3 code
   times its tile's float32 scale, one IEEE multiplication) and encoded, without the float32 copy.
   `x` holds `rows` rows of `cols` e4m3 codes, the rows `first_row`.. of a weight whose tile scales
   `tile_scales` are [ceil(all rows/tile_rows), ceil(cols/tile_cols)] float32 (one expert's gate or up
   half is such a run of rows); `e4m3` maps each code to its exact float32 value. tile_cols must be a
   multiple of 32, so that no block of 32 straddles two tiles. */
int mxfp4_encode_fp8(const uint8_t *x, int64_t rows, int64_t cols, int64_t first_row, const float *tile_scales,
                     int64_t tile_rows, int64_t tile_cols, const float *e4m3, uint8_t *packed, uint8_t *scales) {
    int64_t scale_cols = (cols + tile_cols - 1) / tile_cols;
    uint32_t bits[GROUP];
    for (int64_t r = 0; r < rows; r++) {
        const float *row_scales = tile_scales + ((first_row + r) / tile_rows) * scale_cols;
        for (int64_t c = 0; c < cols; c += GROUP) {
            float s = row_scales[c / tile_cols];
            for (int i = 0; i < GROUP; i++) {
                float value = e4m3[x[r * cols + c + i]] * s;
                memcpy(&bits[i], &value, sizeof value);
            }
            int64_t block = (r * cols + c) / GROUP;
            if (encode_block(bits, packed + block * (GROUP / 2), scales + block)) return -1;
        }
    }
    return 0;
}

/* The scale part alone, for the proof: for each amax (as float32 bits), the reciprocal of the scale the
   block is divided by and the scale byte written. */
void mxfp4_block_scales(const uint32_t *amax, int64_t n, float *inverse, uint8_t *scales) {
    for (int64_t i = 0; i < n; i++) {
        int e = shared_exponent(amax[i] & 0x7FFFFFFFu);
        inverse[i] = inverse_scale(e);
        scales[i] = (uint8_t)((e < -126 ? -126 : e) + 127);
    }
}
