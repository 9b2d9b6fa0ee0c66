/* The float32 -> float16 / bfloat16 conversion pass in one loop: value checks and cast together.
 *
 * Optional: dtypeaudit/fused.py uses it when it was built and falls back to numpy (values.ValueCheck and
 * npcast, which compute the same figures in about sixteen passes) when it was not. Both give the same bits and the
 * same figures: tests/test_fused.py compares them on every float16 value, every float32 exponent's rounding
 * boundaries, NaN payloads and random bit patterns, and holds this loop's bytes and errors against torch's own
 * cast (tests/test_values.py and tests/test_npcast.py hold the numpy path against torch). A review compared the two
 * paths on all 2^32 float32 bit patterns, for both targets and both builds (AVX2 clone and baseline): no difference.
 *
 * Per value, from |x|'s bit pattern a (IEEE binary32, round to nearest even; no fast-math: every float
 * operation here must round exactly as one float32 operation):
 *   float16: the cast as vcvtps2ph writes it (NaN quieted with its sign and top payload bits), NaN/Inf present,
 *            finite values that become inf, the largest finite |x|, non-zero values, values that become zero,
 *            values that land among float16's subnormals, and the largest |cast - x| and |cast - x| / max(|x|, tiny);
 *   bfloat16: the cast as torch's vectorised loop writes it (NaN as 0xFFFF), NaN/Inf, overflow, the largest
 *            finite |x| and the two errors (float16's range counts are float16's alone).
 * A value that becomes inf (or is NaN/Inf) errs by 0, as torch's measure leaves inf differences out.
 *
 * The loop has no branches so that the compiler vectorises it; counts are kept in 32 bits over blocks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(_MSC_VER)
#define restrict __restrict
#endif

#define F32_INF 0x7F800000u
#define F32_TINY 0x00800000u       /* 2^-126, float32's smallest normal */
#define F16_NORMAL 0x38800000u     /* 2^-14, float16's smallest normal */
#define F16_ZERO_UPTO 0x33000000u  /* 2^-25: at or below, a value becomes zero */
#define F16_SUB_BELOW 0x387FE000u  /* 2^-14 - 2^-25: below, a value lands among subnormals */
#define F16_INF_FROM 0x477FF000u   /* 65520: from here on a value becomes inf */
#define F16_SPECIAL 0x47800000u    /* 2^16: the rebiased rounding no longer applies */
#define BF16_INF_FROM 0x7F7F8000u

#define TWO_TO_MINUS_24 5.9604644775390625e-08f /* exact: float16's subnormal step */
#define BLOCK 65536 /* values per block of 32-bit counts */
#define COPIED 2048 /* values per block copied from an unaligned source */

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Selections as masks: gcc vectorises a loop whose reductions are fed by masks, not one fed by ?: chains. */
static inline uint32_t kept_if(int cond, uint32_t v) { return v & (0u - (uint32_t)cond); }
static inline uint32_t chosen(int cond, uint32_t if_true, uint32_t if_false) {
    uint32_t mask = 0u - (uint32_t)cond;
    return (if_true & mask) | (if_false & ~mask);
}

typedef struct {
    unsigned long long nonzero, nonfinite, overflow, underflow, subnormal;
    uint32_t finite_top;
    float max_error, max_relative;
} Figures;

/* Where gcc or clang can dispatch at load time (ELF with glibc's ifunc), each loop is also built for AVX2, which
   runs it about a third faster where the CPU has it; elsewhere the baseline build (SSE2 on x86-64) runs. */
#if defined(__x86_64__) && defined(__GLIBC__) && (defined(__clang__) || __GNUC__ >= 6) && !defined(FUSED_BASELINE_ONLY)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* |x|'s bits and every threshold here are below 2^31: compared as int32 (one instruction each, where an unsigned
   comparison is emulated), and their maxima are signed maxima. */
static inline int32_t imax(int32_t p, int32_t q) { return p > q ? p : q; }
static inline int32_t imin(int32_t p, int32_t q) { return p < q ? p : q; }

VECTOR_CLONES static void float16_block(const uint32_t *restrict x, uint16_t *restrict out, Py_ssize_t n, Figures *restrict f) {
    uint32_t nonzero = 0, nonfinite = 0, overflow = 0, underflow = 0, subnormal = 0;
    int32_t top = (int32_t)f->finite_top, worst = (int32_t)bits_of(f->max_error);
    int32_t relative = (int32_t)bits_of(f->max_relative);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t b = x[i];
        int32_t a = (int32_t)(b & 0x7FFFFFFFu);
        float af = float_of((uint32_t)a);
        /* normal range: rebias the exponent by -112 (the add wraps to it), add just under half a step plus the
           kept lowest bit, drop 13 bits; below 2^-14 the step is 2^-24 whatever the exponent, and adding 0.5 lets
           the float adder round (the sum's low bits are the subnormal, or the smallest normal rounded up) */
        uint32_t normal = ((((uint32_t)a >> 13) & 1u) + (uint32_t)a + 0xC8000FFFu) >> 13;
        uint32_t small = bits_of(af + 0.5f) - 0x3F000000u;
        uint32_t special = chosen(a > (int32_t)F32_INF, 0x7E00u | (((uint32_t)a >> 13) & 0x3FFu), 0x7C00u);
        uint32_t h = chosen(a >= (int32_t)F16_SPECIAL, special, chosen(a < (int32_t)F16_NORMAL, small, normal));
        out[i] = (uint16_t)(h | ((b >> 16) & 0x8000u));
        /* the cast's value back in float32, exactly: a normal half by its bits, a subnormal as a multiple of 2^-24;
           both are computed and one is chosen on the bits (no float operation is conditional: the loop vectorises) */
        uint32_t as_normal = (h << 13) + (112u << 23);
        uint32_t as_subnormal = bits_of((float)(int32_t)h * TWO_TO_MINUS_24);
        float back = float_of(chosen((int32_t)h >= 0x400, as_normal, as_subnormal));
        int32_t error = (int32_t)kept_if(a < (int32_t)F16_INF_FROM, bits_of(back - af) & 0x7FFFFFFFu);
        int32_t scale = imin(imax(a, (int32_t)F32_TINY), (int32_t)F32_INF);
        int32_t ratio = (int32_t)bits_of(float_of((uint32_t)error) / float_of((uint32_t)scale));
        /* both are finite and non-negative: their bit patterns order as their values */
        worst = imax(worst, error);
        relative = imax(relative, ratio);
        top = imax(top, (int32_t)kept_if(a < (int32_t)F32_INF, (uint32_t)a));
        nonzero += a != 0;
        nonfinite += a >= (int32_t)F32_INF;
        overflow += (a >= (int32_t)F16_INF_FROM) & (a < (int32_t)F32_INF);
        underflow += (a > 0) & (a <= (int32_t)F16_ZERO_UPTO);
        subnormal += (a > (int32_t)F16_ZERO_UPTO) & (a < (int32_t)F16_SUB_BELOW);
    }
    f->nonzero += nonzero;
    f->nonfinite += nonfinite;
    f->overflow += overflow;
    f->underflow += underflow;
    f->subnormal += subnormal;
    f->finite_top = (uint32_t)top;
    f->max_error = float_of((uint32_t)worst);
    f->max_relative = float_of((uint32_t)relative);
}

VECTOR_CLONES static void bfloat16_block(const uint32_t *restrict x, uint16_t *restrict out, Py_ssize_t n, Figures *restrict f) {
    uint32_t nonfinite = 0, overflow = 0;
    int32_t top = (int32_t)f->finite_top, worst = (int32_t)bits_of(f->max_error);
    int32_t relative = (int32_t)bits_of(f->max_relative);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t b = x[i];
        int32_t a = (int32_t)(b & 0x7FFFFFFFu);
        /* the top 16 bits rounded to nearest even: add just under half a step plus the kept lowest bit (a finite
           value within half a step of float32's top carries into inf's pattern); NaN is 0xFFFF */
        uint32_t rounded = ((((uint32_t)a >> 16) & 1u) + 0x7FFFu + (uint32_t)a) & 0xFFFF0000u;
        uint32_t h = chosen(a > (int32_t)F32_INF, 0xFFFFu, (rounded >> 16) | ((b >> 16) & 0x8000u));
        out[i] = (uint16_t)h;
        uint32_t difference = bits_of(float_of(rounded) - float_of((uint32_t)a)) & 0x7FFFFFFFu;
        int32_t error = (int32_t)kept_if(a < (int32_t)BF16_INF_FROM, difference);
        int32_t scale = imin(imax(a, (int32_t)F32_TINY), (int32_t)F32_INF);
        int32_t ratio = (int32_t)bits_of(float_of((uint32_t)error) / float_of((uint32_t)scale));
        worst = imax(worst, error);
        relative = imax(relative, ratio);
        top = imax(top, (int32_t)kept_if(a < (int32_t)F32_INF, (uint32_t)a));
        nonfinite += a >= (int32_t)F32_INF;
        overflow += (a >= (int32_t)BF16_INF_FROM) & (a < (int32_t)F32_INF);
    }
    f->nonfinite += nonfinite;
    f->overflow += overflow;
    f->finite_top = (uint32_t)top;
    f->max_error = float_of((uint32_t)worst);
    f->max_relative = float_of((uint32_t)relative);
}

/* fold_cast(source, out, bfloat16) -> (nonzero, nonfinite, overflow, underflow, subnormal, finite_top_bits,
   max_error, max_relative): source holds float32 values (any alignment), out room for as many 16-bit values. */
static PyObject *fold_cast(PyObject *self, PyObject *args) {
    Py_buffer source, out;
    int bfloat16;
    if (!PyArg_ParseTuple(args, "y*w*p", &source, &out, &bfloat16))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = source.len / 4;
    if (source.len % 4 != 0 || out.len < 2 * n || ((uintptr_t)out.buf & 1u) != 0) {
        PyErr_SetString(PyExc_ValueError, "fold_cast: source is not whole float32 values, or out is too small or unaligned");
        goto done;
    }
    Figures f = {0, 0, 0, 0, 0, 0, 0.0f, 0.0f};
    const char *src = (const char *)source.buf;
    uint16_t *dst = (uint16_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    int unaligned = ((uintptr_t)src & 3u) != 0; /* a storage need not be 4-aligned (in a zip entry, say) */
    Py_ssize_t step = unaligned ? COPIED : BLOCK;
    uint32_t copied[COPIED];
    for (Py_ssize_t start = 0; start < n; start += step) {
        Py_ssize_t count = n - start < step ? n - start : step;
        const uint32_t *x = (const uint32_t *)(src + 4 * start);
        if (unaligned) {
            memcpy(copied, src + 4 * start, (size_t)(4 * count));
            x = copied;
        }
        if (bfloat16)
            bfloat16_block(x, dst + start, count, &f);
        else
            float16_block(x, dst + start, count, &f);
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(KKKKKkdd)", f.nonzero, f.nonfinite, f.overflow, f.underflow, f.subnormal,
                           (unsigned long)f.finite_top, (double)f.max_error, (double)f.max_relative);
done:
    PyBuffer_Release(&source);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"fold_cast", fold_cast, METH_VARARGS, "Cast float32 values to float16 or bfloat16 bits and fold their checks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fused_kernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit_fused_kernel(void) { return PyModule_Create(&module); }
