/* ckptzip._bpnative: the CPU byteplane transform (docs/format.md, "byteplane") in one pass.
 *
 * The numpy version needs a rotation pass and one strided pass per plane over cache-sized steps
 * (about 2 GB/s per core); here each word is rotated and its bytes scattered to (or gathered
 * from) their planes in one pass, 16 words per SSE2 step on x86-64, a plain loop elsewhere.
 * The functions release the GIL; callers split the words between threads.
 *
 *   encode(src, out, width, block, w0, w1[, pre])  planes of words w0..w1 of src into out; pre:
 *       ("grid", r, c, g0) or ("ref", words), expgrid's / expref's residual of each float32 word
 *       made just before its planes (the residual is never written out)
 *   decode(src, dst, width, block, w0, w1)        words w0..w1 of dst from the planes in src
 *   decode_onto(src, dst, ref, width, block, fold, w0, w1)
 *       the same, then combined with ref (fold 1: xor; 2: delta, the sign-folded difference
 *       added back) into dst (ref may be dst)
 *   exp_grid(src, out, r, c, w0, sign)
 *       expgrid's residual (sign -1) or its inverse (sign 1) of float32 words src into out: the
 *       exponent field plus sign x ((r[row] + c[col]) >> 8) mod 256 for word w0 + i of a
 *       len(r) x len(c) grid (r, c: int32); sign bit and mantissa kept (out may be src)
 *   exp_fit(src, rm, cm, rows, cols, kc, kr)
 *       expgrid's CPU fit: row means of the exponent field (every kc-th column), column means of
 *       what the rows leave (every kr-th row), float64 out
 *   exp_ref(src, out, ref, sign)
 *       expref's: the exponent field plus sign x (the reference word's field >> 1) mod 256
 *   plane_entropy(src, bits, width, starts, run)
 *       order-0 entropy (bits per byte, float64 x width) of every byte plane of the rotated
 *       words of the runs src[starts[i]:+run] (word indices): the CPU planner's sample
 *   top_entropy(src[, step])
 *       the same for the top plane alone of 4-byte words (the float32 exponent field), as a float;
 *       with a step (see encode), of the words' expgrid / expref residual, made a buffer at a time
 *   plane_entropy_many(srcs, widths, bits, run)
 *       the same for many buffers at once, each over 4 runs spread as the planner spreads them,
 *       in one call without the GIL (a save's estimates, on a pool thread beside planning)
 *   copy_segments(src, dst, soffs, doffs, lens)
 *       dst[doffs[i]:+lens[i]] = src[soffs[i]:+lens[i]] for every i (int64 arrays), every
 *       segment checked against both buffers before anything is copied
 *   zstd_decode(src, dst, soffs, ssizes, doffs, dsizes)
 *       every chunk src[soffs[i]:+ssizes[i]], exactly one zstd frame, decoded into
 *       dst[doffs[i]:+dsizes[i]] (int64 arrays) with the system's libzstd (dlopen'd, 1.4 or
 *       later); a frame must decode to exactly dsizes[i] bytes (its declared content size, if
 *       any, is checked first; the output can never exceed its slot; legacy and skippable frames
 *       are refused by their magic number). Returns None, or (index, message) of the first chunk
 *       that failed; src and dst must not overlap. zstd_version(): libzstd's version number, or 0
 *       where none was found (callers then use python-zstandard)
 *
 *   planes_fused(src, dst, width, planes, words0, words, soffs, ssizes, w0, w1[, xxh3])
 *       words w0..w1 of dst from their byte planes' chunks in src, stored ones read in place,
 *       zstd ones decoded into a chunk-sized scratch per plane, in one pass over dst (the
 *       byteplane decode fused with the codec; see the function); with xxh3 (uint64 per
 *       chunk), the chunks holding words w0..w1 are verified first
 *
 *   planes_fused_many(src, items, order, counter)
 *       many planes_fused calls (items: tuples of its other arguments) taken in `order` from a
 *       shared atomic counter by every thread that calls it with the same arguments
 *
 *   xxh3_load(path), xxh3_many(buf, offs, sizes, out)
 *       XXH3-64 (seed 0) taken from the already loaded shared object `path` (the xxhash
 *       package's extension: python-xxhash exports libxxhash's API, XXH3_64bits_dispatch
 *       preferred: its SIMD width chosen at run time); then the XXH3-64 of every
 *       chunk buf[offs[i]:+sizes[i]] into out[i] (uint64) without the GIL. native.py checks the
 *       loaded function against xxhash's Python API before anything uses it
 *
 *   zstd_encode(src, dst, soffs, ssizes, doffs, dcaps, osizes, params)
 *       every chunk src[soffs[i]:+ssizes[i]] as one zstd frame into dst[doffs[i]:+dcaps[i]],
 *       its size into osizes[i], with libzstd's parameters given as int32 (id, value) pairs
 *       (experimental ones included); None, or (index, message) of the first failure
 *
 *   json_members(text, obj)
 *       (members written in the UTF-8 JSON text, items in the dicts of obj, what json.loads
 *       made of it): equal exactly when no object repeats a name (strict_json's check)
 *
 *   fs_type(fd), fallocate(fd, mode, offset, length)
 *       fstatfs's f_type; Linux fallocate(2) without the GIL (an OSError on failure)
 *
 *   huge_pages(buf)
 *       madvise(MADV_HUGEPAGE) on the whole 2 MiB pages inside the writable buffer buf (Linux;
 *       before the buffer is first written). Returns the bytes advised (0: none, or not Linux)
 *
 *   cast_bf16(src, out[, other])
 *       ``derived``'s prediction (docs/format.md): every float32 word of src (4-byte words in
 *       the host's byte order, as the numpy formula reads them) cast to bfloat16 by
 *       round-to-nearest-even of its bit pattern, (u + 0x7FFF + ((u >> 16) & 1)) >> 16, every
 *       NaN 0x7FC0, into out (2 bytes a word), in one pass (without the GIL from RELEASE_MIN
 *       bytes of src on); with other (as long as out, out itself or apart from it), the
 *       prediction xor other's half-words (``derived``'s residual, or the words from it)
 *   cast_bf16_diff(src, tgt)
 *       how many bfloat16 words of tgt differ from cast_bf16's prediction of src's words (the
 *       planner's check of a ``derived`` pair), in one pass (the GIL as cast_bf16)
 *
 *   pread_many(fd, buf, foffs, boffs, lens, threads)
 *       buf[boffs[i]:+lens[i]] = the file's bytes at foffs[i] (int64 arrays) for every i, by
 *       `threads` POSIX threads taking the ranges in turn, without the GIL for the whole call
 *       (Python read threads each needed the GIL back after every read, which the caller's
 *       thread held while it decoded). Returns None, or an offset at or past the file's end
 *       that a range reached (reads stop at the first short range); an I/O error is an OSError
 *
 * Buffers are any contiguous objects with the buffer protocol (numpy arrays): sizes and word
 * ranges are checked here, so a wrong call is a Python exception, never a stray write.
 */
#define PY_SSIZE_T_CLEAN
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* fallocate */
#endif
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <unistd.h>
#include <fcntl.h>
#if defined(__linux__)
#include <sys/vfs.h>
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Words are read and written through these types: buffers need not be aligned to their width
 * (alignment 1, no strict-aliasing assumptions; plain loads and stores on x86-64 and arm64). */
#if defined(__GNUC__)
typedef uint16_t u16a __attribute__((aligned(1), may_alias));
typedef uint32_t u32a __attribute__((aligned(1), may_alias));
typedef uint64_t u64a __attribute__((aligned(1), may_alias));
typedef int32_t i32a __attribute__((aligned(1), may_alias));
typedef int64_t i64a __attribute__((aligned(1), may_alias));
#else
typedef uint16_t u16a;
typedef uint32_t u32a;
typedef uint64_t u64a;
typedef int32_t i32a;
typedef int64_t i64a;
#endif

/* Whether two buffers share a byte. */
static int overlap(const Py_buffer *a, const Py_buffer *b) {
    return (const char *)a->buf < (const char *)b->buf + b->len && (const char *)b->buf < (const char *)a->buf + a->len;
}


/* Small work keeps the GIL: a thread that gives it back waits up to the interpreter's switch
 * interval (5 ms) to take it again while another thread runs Python, far more than a sample's
 * histogram or a bias's planes take (the CPU planner's entropy samples spent most of their
 * time there while an encoding thread ran). */
#define RELEASE_MIN (256LL << 10)
#define BEGIN_MAYBE(nbytes) { PyThreadState *_ts = (long long)(nbytes) >= RELEASE_MIN ? PyEval_SaveThread() : NULL;
#define END_MAYBE if (_ts) PyEval_RestoreThread(_ts); }

typedef struct { Py_buffer src, dst, ref; int has_ref; } bufs_t;

static void release(bufs_t *b) {
    PyBuffer_Release(&b->src);
    PyBuffer_Release(&b->dst);
    if (b->has_ref) PyBuffer_Release(&b->ref);
}

/* one block's words j0..j1 (block of m words at planes p, word array at words) */
static void enc_run(const uint8_t *words, uint8_t *p, int w, int64_t m, int64_t j0, int64_t j1) {
    int64_t j = j0;
    if (w == 4) {
        const u32a *x = (const u32a *)words;
        uint8_t *p0 = p, *p1 = p + m, *p2 = p + 2 * m, *p3 = p + 3 * m;
#if defined(__SSE2__)
        const __m128i lo = _mm_set1_epi32(0xFF);
        for (; j + 16 <= j1; j += 16) {
            __m128i v[4], b0[4], b1[4], b2[4], b3[4];
            for (int k = 0; k < 4; k++) {
                __m128i a = _mm_loadu_si128((const __m128i *)(x + j + 4 * k));
                a = _mm_or_si128(_mm_slli_epi32(a, 1), _mm_srli_epi32(a, 31));
                v[k] = a;
                b0[k] = _mm_and_si128(a, lo);
                b1[k] = _mm_and_si128(_mm_srli_epi32(a, 8), lo);
                b2[k] = _mm_and_si128(_mm_srli_epi32(a, 16), lo);
                b3[k] = _mm_srli_epi32(a, 24);
            }
            /* values < 256: signed 32->16 and unsigned 16->8 saturation are exact */
#define PACK(b) _mm_packus_epi16(_mm_packs_epi32(b[0], b[1]), _mm_packs_epi32(b[2], b[3]))
            _mm_storeu_si128((__m128i *)(p0 + j), PACK(b0));
            _mm_storeu_si128((__m128i *)(p1 + j), PACK(b1));
            _mm_storeu_si128((__m128i *)(p2 + j), PACK(b2));
            _mm_storeu_si128((__m128i *)(p3 + j), PACK(b3));
#undef PACK
            (void)v;
        }
#endif
        for (; j < j1; j++) {
            uint32_t a = x[j];
            a = (a << 1) | (a >> 31);
            p0[j] = (uint8_t)a; p1[j] = (uint8_t)(a >> 8); p2[j] = (uint8_t)(a >> 16); p3[j] = (uint8_t)(a >> 24);
        }
    } else if (w == 2) {
        const u16a *x = (const u16a *)words;
        uint8_t *p0 = p, *p1 = p + m;
#if defined(__SSE2__)
        const __m128i lo = _mm_set1_epi16(0xFF);
        for (; j + 16 <= j1; j += 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)(x + j));
            __m128i c = _mm_loadu_si128((const __m128i *)(x + j + 8));
            a = _mm_or_si128(_mm_slli_epi16(a, 1), _mm_srli_epi16(a, 15));
            c = _mm_or_si128(_mm_slli_epi16(c, 1), _mm_srli_epi16(c, 15));
            _mm_storeu_si128((__m128i *)(p0 + j), _mm_packus_epi16(_mm_and_si128(a, lo), _mm_and_si128(c, lo)));
            _mm_storeu_si128((__m128i *)(p1 + j), _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(c, 8)));
        }
#endif
        for (; j < j1; j++) {
            uint16_t a = x[j];
            a = (uint16_t)((a << 1) | (a >> 15));
            p0[j] = (uint8_t)a; p1[j] = (uint8_t)(a >> 8);
        }
    } else { /* 8 */
        const u64a *x = (const u64a *)words;
        for (; j < j1; j++) {
            uint64_t a = x[j];
            a = (a << 1) | (a >> 63);
            for (int k = 0; k < 8; k++) p[k * m + j] = (uint8_t)(a >> (8 * k));
        }
    }
}

/* words j0..j1 from their planes: byte k of word j is pp[k][j]; fold: 0 plain, 1 xor with ref,
 * 2 delta (unfold, add ref) */
static void dec_ptrs(const uint8_t *const *pp, uint8_t *words, const uint8_t *refw, int fold, int w,
                     int64_t j0, int64_t j1) {
    int64_t j = j0;
    if (w == 4) {
        u32a *y = (u32a *)words;
        const u32a *r = (const u32a *)refw;
        const uint8_t *p0 = pp[0], *p1 = pp[1], *p2 = pp[2], *p3 = pp[3];
#if defined(__SSE2__)
        if (fold == 0) {
            for (; j + 16 <= j1; j += 16) {
                __m128i a0 = _mm_loadu_si128((const __m128i *)(p0 + j));
                __m128i a1 = _mm_loadu_si128((const __m128i *)(p1 + j));
                __m128i a2 = _mm_loadu_si128((const __m128i *)(p2 + j));
                __m128i a3 = _mm_loadu_si128((const __m128i *)(p3 + j));
                __m128i l01 = _mm_unpacklo_epi8(a0, a1), h01 = _mm_unpackhi_epi8(a0, a1);
                __m128i l23 = _mm_unpacklo_epi8(a2, a3), h23 = _mm_unpackhi_epi8(a2, a3);
                __m128i v[4] = {_mm_unpacklo_epi16(l01, l23), _mm_unpackhi_epi16(l01, l23),
                                _mm_unpacklo_epi16(h01, h23), _mm_unpackhi_epi16(h01, h23)};
                for (int k = 0; k < 4; k++) {
                    __m128i a = _mm_or_si128(_mm_srli_epi32(v[k], 1), _mm_slli_epi32(v[k], 31));
                    _mm_storeu_si128((__m128i *)(y + j + 4 * k), a);
                }
            }
        }
#endif
        for (; j < j1; j++) {
            uint32_t a = (uint32_t)p0[j] | ((uint32_t)p1[j] << 8) | ((uint32_t)p2[j] << 16) | ((uint32_t)p3[j] << 24);
            a = (a >> 1) | (a << 31);
            if (fold == 1) a ^= r[j];
            else if (fold == 2) a = r[j] + (a ^ ((a >> 31) * 0x7FFFFFFFu));
            y[j] = a;
        }
    } else if (w == 2) {
        u16a *y = (u16a *)words;
        const u16a *r = (const u16a *)refw;
        const uint8_t *p0 = pp[0], *p1 = pp[1];
#if defined(__SSE2__)
        if (fold == 0) {
            for (; j + 16 <= j1; j += 16) {
                __m128i a0 = _mm_loadu_si128((const __m128i *)(p0 + j));
                __m128i a1 = _mm_loadu_si128((const __m128i *)(p1 + j));
                __m128i l = _mm_unpacklo_epi8(a0, a1), h = _mm_unpackhi_epi8(a0, a1);
                l = _mm_or_si128(_mm_srli_epi16(l, 1), _mm_slli_epi16(l, 15));
                h = _mm_or_si128(_mm_srli_epi16(h, 1), _mm_slli_epi16(h, 15));
                _mm_storeu_si128((__m128i *)(y + j), l);
                _mm_storeu_si128((__m128i *)(y + j + 8), h);
            }
        }
#endif
        for (; j < j1; j++) {
            uint16_t a = (uint16_t)(p0[j] | (p1[j] << 8));
            a = (uint16_t)((a >> 1) | (a << 15));
            if (fold == 1) a ^= r[j];
            else if (fold == 2) a = (uint16_t)(r[j] + (a ^ ((a >> 15) * 0x7FFFu)));
            y[j] = a;
        }
    } else { /* 8 */
        u64a *y = (u64a *)words;
        const u64a *r = (const u64a *)refw;
        for (; j < j1; j++) {
            uint64_t a = 0;
            for (int k = 0; k < 8; k++) a |= (uint64_t)pp[k][j] << (8 * k);
            a = (a >> 1) | (a << 63);
            if (fold == 1) a ^= r[j];
            else if (fold == 2) a = r[j] + (a ^ ((a >> 63) * 0x7FFFFFFFFFFFFFFFull));
            y[j] = a;
        }
    }
}

/* the same for one block of m words whose planes follow each other from p */
static void dec_run(const uint8_t *p, uint8_t *words, const uint8_t *refw, int fold, int w, int64_t m,
                    int64_t j0, int64_t j1) {
    const uint8_t *pp[8];
    for (int k = 0; k < w; k++) pp[k] = p + k * m;
    dec_ptrs(pp, words, refw, fold, w, j0, j1);
}

/* Checks shared by the three functions; 0 on success (else a Python error is set). */
static int check(bufs_t *b, int w, long long block, long long w0, long long w1) {
    if (w != 2 && w != 4 && w != 8) {
        PyErr_SetString(PyExc_ValueError, "width must be 2, 4 or 8");
        return -1;
    }
    if (block < 1) {
        PyErr_SetString(PyExc_ValueError, "block must be >= 1");
        return -1;
    }
    if (b->src.len != b->dst.len || b->src.len % w || (b->has_ref && b->ref.len != b->src.len)) {
        PyErr_SetString(PyExc_ValueError, "buffers must have one size, a multiple of width");
        return -1;
    }
    long long n = b->src.len / w;
    if (w0 < 0 || w1 < w0 || w1 > n) {
        PyErr_SetString(PyExc_ValueError, "word range outside the buffers");
        return -1;
    }
    if (overlap(&b->src, &b->dst)) {
        PyErr_SetString(PyExc_ValueError, "src and dst overlap");
        return -1;
    }
    return 0;
}

/* the words w0..w1 cut at block boundaries: f(block start word s, block words m, j0, j1) */
#define FOR_BLOCKS(n, block, w0, w1, BODY)                                  \
    for (long long i = (w0); i < (w1);) {                                   \
        long long s = i / (block) * (block);                                \
        long long m = (n) - s < (block) ? (n) - s : (block);                \
        long long e = s + m < (w1) ? s + m : (w1);                          \
        long long j0 = i - s, j1 = e - s;                                   \
        BODY;                                                               \
        i = e;                                                              \
    }

static void exp_grid_run(const u32a *x, u32a *o, const i32a *rr, const i32a *cc, long long cols, long long w0,
                         long long n, int sign);
static void exp_ref_run(const u32a *x, u32a *o, const u32a *f, long long n, int sign);

/* Whether n float32 words from grid word g0 lie inside an expgrid of int32 terms r (rlen bytes:
 * rows) and c (clen bytes: columns); else a ValueError is set. */
static int grid_fits(Py_ssize_t rlen, Py_ssize_t clen, long long g0, long long n) {
    long long cells;
    if (rlen % 4 || clen % 4 || clen < 4 || g0 < 0 ||
        __builtin_mul_overflow((long long)(rlen / 4), (long long)(clen / 4), &cells) || g0 > cells ||
        n > cells - g0) {
        PyErr_SetString(PyExc_ValueError, "expgrid: words outside the grid");
        return 0;
    }
    return 1;
}

/* A step on float32 words beside the byte planes: expgrid's (kind 1; a: r, b: c, int32; g0:
 * the grid word of the first word) or expref's (kind 2; a: the reference's words beside the
 * words'): encode's pre step makes each word's residual just before its planes,
 * planes_fused_many's post step undoes it on a piece's words once decoded. */
typedef struct { int kind; Py_buffer a, b; long long g0; } step_t;

/* Parse a step (None: kind 0) for `len` bytes of words of width w, written into `out` (NULL:
 * nothing is written): 0, or -1 with a Python exception set. */
static int step_parse(PyObject *po, step_t *p, Py_ssize_t len, const Py_buffer *out, int w) {
    if (po == Py_None) return 0;
    PyObject *k0 = PyTuple_Check(po) && PyTuple_GET_SIZE(po) ? PyTuple_GET_ITEM(po, 0) : NULL;
    const char *kind = k0 && PyUnicode_Check(k0) ? PyUnicode_AsUTF8(k0) : NULL;
    if (kind && !strcmp(kind, "grid")) {
        if (!PyArg_ParseTuple(po, "sy*y*L", &kind, &p->a, &p->b, &p->g0)) return -1;
        p->kind = 1;
    } else if (kind && !strcmp(kind, "ref")) {
        if (!PyArg_ParseTuple(po, "sy*", &kind, &p->a)) return -1;
        p->kind = 2;
    } else {
        PyErr_SetString(PyExc_ValueError, "a step is (\"grid\", r, c, g0) or (\"ref\", words)");
        return -1;
    }
    if (w % 4) {
        PyErr_SetString(PyExc_ValueError, "a grid or reference step needs whole float32 words");
        return -1;
    }
    if (p->kind == 1 && !grid_fits(p->a.len, p->b.len, p->g0, len / 4)) return -1;
    if (p->kind == 2 && (p->a.len != len || (out && overlap(&p->a, out)))) {
        PyErr_SetString(PyExc_ValueError, "expref: the reference must be as long as its words and apart from the output");
        return -1;
    }
    return 0;
}

static void step_release(step_t *p) {
    PyBuffer_Release(&p->a);
    PyBuffer_Release(&p->b);
}

/* The step on the k float32 words x[0..k) (word index `at` of the step's words) into o (sign
 * -1: the residual, 1: its inverse; o may be x) */
static void step_run(const step_t *p, const u32a *x, u32a *o, long long at, long long k, int sign) {
    if (p->kind == 1)
        exp_grid_run(x, o, p->a.buf, p->b.buf, p->b.len / 4, p->g0 + at, k, sign);
    else
        exp_ref_run(x, o, (const u32a *)p->a.buf + at, k, sign);
}

#define PRE_SEG 2048
/* enc_run of words j0..j1 (of w bytes) of the block at word s, each first through the step */
static void enc_pre_run(const uint8_t *src, uint8_t *dst, long long s, int w, long long m, long long j0,
                        long long j1, const step_t *p) {
    uint32_t tmp[PRE_SEG * 2]; /* (PRE_SEG words of up to 8 bytes) */
    long long q = w / 4;       /* float32 words per word */
    for (long long jj = j0; jj < j1; jj += PRE_SEG) {
        long long je = jj + PRE_SEG < j1 ? jj + PRE_SEG : j1;
        step_run(p, (const u32a *)src + (s + jj) * q, (u32a *)tmp, (s + jj) * q, (je - jj) * q, -1);
        /* (tmp holds words jj..je: as words 0..je-jj of a block whose planes start jj bytes on) */
        enc_run((const uint8_t *)tmp, dst + s * w + jj, w, m, 0, je - jj);
    }
}

/* byteplane encode (decode = 0) or decode (1) of words w0..w1; encode takes an optional pre step */
static PyObject *planes(PyObject *args, int decode) {
    bufs_t b = {0};
    int w;
    long long block, w0, w1;
    PyObject *po = Py_None;
    step_t pre;
    memset(&pre, 0, sizeof pre);
    if (!PyArg_ParseTuple(args, decode ? "y*w*iLLL" : "y*w*iLLL|O", &b.src, &b.dst, &w, &block, &w0, &w1, &po))
        return NULL;
    if (check(&b, w, block, w0, w1) || step_parse(po, &pre, b.src.len, &b.dst, w)) {
        release(&b);
        step_release(&pre);
        return NULL;
    }
    long long n = b.src.len / w;
    const uint8_t *src = b.src.buf;
    uint8_t *dst = b.dst.buf;
    BEGIN_MAYBE((w1 - w0) * w)
    if (decode) {
        FOR_BLOCKS(n, block, w0, w1, dec_run(src + s * w, dst + s * w, NULL, 0, w, m, j0, j1))
    } else if (pre.kind) {
        FOR_BLOCKS(n, block, w0, w1, enc_pre_run(src, dst, s, w, m, j0, j1, &pre))
    } else {
        FOR_BLOCKS(n, block, w0, w1, enc_run(src + s * w, dst + s * w, w, m, j0, j1))
    }
    END_MAYBE
    release(&b);
    step_release(&pre);
    Py_RETURN_NONE;
}

static PyObject *py_encode(PyObject *self, PyObject *args) { (void)self; return planes(args, 0); }

static PyObject *py_decode(PyObject *self, PyObject *args) { (void)self; return planes(args, 1); }

static PyObject *py_decode_onto(PyObject *self, PyObject *args) {
    (void)self;
    bufs_t b = {0};
    int w, fold;
    long long block, w0, w1;
    if (!PyArg_ParseTuple(args, "y*w*y*iLiLL", &b.src, &b.dst, &b.ref, &w, &block, &fold, &w0, &w1)) return NULL;
    b.has_ref = 1;
    if (check(&b, w, block, w0, w1)) { release(&b); return NULL; }
    if (fold != 1 && fold != 2) {
        release(&b);
        PyErr_SetString(PyExc_ValueError, "fold must be 1 (xor) or 2 (delta)");
        return NULL;
    }
    /* ref is dst (in place: each word is read before it is written) or apart from it, and never
     * overlaps src: a partial overlap would make the result depend on the thread split */
    if (overlap(&b.ref, &b.src) || (b.ref.buf != b.dst.buf && overlap(&b.ref, &b.dst))) {
        release(&b);
        PyErr_SetString(PyExc_ValueError, "ref overlaps src, or overlaps dst without being dst");
        return NULL;
    }
    long long n = b.src.len / w;
    const uint8_t *src = b.src.buf, *ref = b.ref.buf;
    uint8_t *dst = b.dst.buf;
    BEGIN_MAYBE((w1 - w0) * w)
    FOR_BLOCKS(n, block, w0, w1, dec_run(src + s * w, dst + s * w, ref + s * w, fold, w, m, j0, j1))
    END_MAYBE
    release(&b);
    Py_RETURN_NONE;
}

/* A private copy of k int64 tables of one length (what is checked is what is used after the
 * GIL is released, whoever else holds the caller's arrays): k * n values, or NULL with a
 * Python exception set. */
static int64_t *copy_tables(Py_buffer *tb, int k, Py_ssize_t *n) {
    for (int j = 0; j < k; j++) {
        if (tb[j].len % 8 || tb[j].len != tb[0].len) {
            PyErr_SetString(PyExc_ValueError, "offsets and lengths must be int64 arrays of one length");
            return NULL;
        }
    }
    *n = tb[0].len / 8;
    int64_t *t = PyMem_Malloc((size_t)(k * *n + 1) * sizeof(int64_t));
    if (!t) {
        PyErr_NoMemory();
        return NULL;
    }
    for (int j = 0; j < k; j++) memcpy(t + j * *n, tb[j].buf, (size_t)tb[0].len);
    return t;
}

/* The common exit of the functions that take tables: frees the private copy ``t``, releases the
 * ``nb`` buffers ``b`` (all zero-initialized before parsing, so unparsed ones are no-ops) and
 * returns ``ret`` (NULL with the exception set, or the result). */
static PyObject *finish(PyObject *ret, int64_t *t, Py_buffer *b, int nb) {
    PyMem_Free(t);
    for (int k = 0; k < nb; k++) PyBuffer_Release(&b[k]);
    return ret;
}

static PyObject *py_copy_segments(PyObject *self, PyObject *args) {
    Py_buffer b[5] = {{0}}, *src = &b[0], *dst = &b[1], *tb = b + 2;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*y*y*y*", src, dst, &tb[0], &tb[1], &tb[2])) return NULL;
    Py_ssize_t n = 0;
    int64_t *t = copy_tables(tb, 3, &n);
    if (!t) return finish(NULL, t, b, 5);
    const int64_t *s = t, *d = t + n, *l = t + 2 * n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < 0 || d[i] < 0 || l[i] < 0 || s[i] > src->len - l[i] || d[i] > dst->len - l[i]) {
            PyErr_SetString(PyExc_ValueError, "segment outside its buffer");
            return finish(NULL, t, b, 5);
        }
    }
    const char *sb = src->buf;
    char *db = dst->buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) memmove(db + d[i], sb + s[i], (size_t)l[i]);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    return finish(Py_None, t, b, 5);
}

/* x with the exponent field plus q >> 23 (q a multiple of 2^23) mod 256, or minus: bit 31 kept */
static inline uint32_t exp_add(uint32_t x, uint32_t q, int sign) {
    uint32_t o = sign > 0 ? x + q : x - q;
    return (o & 0x7FFFFFFFu) | (x & 0x80000000u);
}

static int same_words(Py_buffer *a, Py_buffer *b) {
    if (a->len != b->len || a->len % 4) {
        PyErr_SetString(PyExc_ValueError, "buffers must have one size, a multiple of 4");
        return -1;
    }
    return 0;
}

/* expgrid's words: o[k] = x[k] with the exponent plus sign x the prediction of grid word w0 + k
 * (x may be o); rows x cols checked by the caller */
static void exp_grid_run(const u32a *x, u32a *o, const i32a *rr, const i32a *cc, long long cols, long long w0,
                         long long n, int sign) {
    long long k = 0;
    while (k < n) {
        long long g = w0 + k, row = g / cols, col = g % cols;
        long long m = cols - col < n - k ? cols - col : n - k;
        int32_t rv = rr[row];
        for (long long j = 0; j < m; j++) {
            /* the sum wraps as numpy's int32 does (unsigned: no undefined overflow) */
            int32_t p = (int32_t)((uint32_t)rv + (uint32_t)cc[col + j]);
            uint32_t q = ((uint32_t)(p >> 8) & 0xFFu) << 23;
            o[k + j] = exp_add(x[k + j], q, sign);
        }
        k += m;
    }
}

/* expref's words: the exponent plus sign x (the reference word's field >> 1) */
static void exp_ref_run(const u32a *x, u32a *o, const u32a *f, long long n, int sign) {
    for (long long k = 0; k < n; k++) o[k] = exp_add(x[k], (f[k] >> 1) & 0x3F800000u, sign);
}

static PyObject *py_exp_grid(PyObject *self, PyObject *args) {
    Py_buffer src = {0}, out = {0}, r = {0}, c = {0};
    long long w0;
    int sign;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*y*y*Li", &src, &out, &r, &c, &w0, &sign)) return NULL;
    PyObject *ret = NULL;
    long long n = src.len / 4, cols = c.len / 4;
    if (same_words(&src, &out) || !grid_fits(r.len, c.len, w0, n)) goto done;
    {
        const u32a *x = src.buf;
        u32a *o = out.buf;
        const i32a *rr = r.buf, *cc = c.buf;
        BEGIN_MAYBE(n * 4)
        exp_grid_run(x, o, rr, cc, cols, w0, n, sign);
        END_MAYBE
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    PyBuffer_Release(&src); PyBuffer_Release(&out); PyBuffer_Release(&r); PyBuffer_Release(&c);
    return ret;
}

/* exp_fit(src, rm, cm, rows, cols, kc, kr): expgrid's CPU fit of the float32 words src (rows x
 * cols): rm[i] = the mean exponent field of row i over columns 0, kc, 2 kc, ...; cm[j] = the
 * mean over rows 0, kr, 2 kr, ... of (exponent - (float)rm[i]) computed in float32 (rm, cm:
 * float64 of rows / cols entries). One pass over the sampled rows instead of numpy's
 * temporaries. */
static PyObject *py_exp_fit(PyObject *self, PyObject *args) {
    Py_buffer src = {0}, rm = {0}, cm = {0};
    long long rows, cols, kc, kr;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*w*LLLL", &src, &rm, &cm, &rows, &cols, &kc, &kr)) return NULL;
    PyObject *ret = NULL;
    long long cells;
    if (rows < 1 || cols < 1 || kc < 1 || kr < 1 || __builtin_mul_overflow(rows, cols, &cells)
        || cells > src.len / 4 || rm.len != rows * 8 || cm.len != cols * 8) {
        PyErr_SetString(PyExc_ValueError, "exp_fit: sizes do not match");
        goto done;
    }
    if (kc > cols) kc = cols; /* (the same samples; no overflow in the rounding below) */
    if (kr > rows) kr = rows;
    {
        const u32a *x = src.buf;
        double *r = rm.buf, *c = cm.buf;
        long long nc = (cols + kc - 1) / kc, nr = (rows + kr - 1) / kr;  /* the samples per row, column */
        BEGIN_MAYBE((rows * nc + nr * cols) * 4)
        for (long long i = 0; i < rows; i++) {
            const u32a *row = x + i * cols;
            uint64_t sum = 0;
            if (kc == 1) { /* (every column: a loop the compiler vectorizes, 32-bit sums of up to 2^23 fields) */
                for (long long j0 = 0; j0 < cols; j0 += 1 << 23) {
                    long long j1 = cols - j0 < (1 << 23) ? cols : j0 + (1 << 23);
                    uint32_t part = 0;
                    for (long long j = j0; j < j1; j++) part += (row[j] >> 23) & 0xFFu;
                    sum += part;
                }
            } else {
                for (long long j = 0; j < cols; j += kc) sum += (row[j] >> 23) & 0xFFu;
            }
            r[i] = (double)sum / (double)nc;
        }
        for (long long j = 0; j < cols; j++) c[j] = 0.0;
        for (long long i = 0; i < rows; i += kr) {
            const u32a *row = x + i * cols;
            float ri = (float)r[i];
            double *restrict cd = c; /* (the sums share no memory with src: the loop vectorizes) */
            for (long long j = 0; j < cols; j++) cd[j] += (double)((float)((row[j] >> 23) & 0xFFu) - ri);
        }
        for (long long j = 0; j < cols; j++) c[j] /= (double)nr;
        END_MAYBE
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    PyBuffer_Release(&src); PyBuffer_Release(&rm); PyBuffer_Release(&cm);
    return ret;
}

static PyObject *py_exp_ref(PyObject *self, PyObject *args) {
    Py_buffer src = {0}, out = {0}, ref = {0};
    int sign;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*y*i", &src, &out, &ref, &sign)) return NULL;
    PyObject *ret = NULL;
    if (same_words(&src, &out) || same_words(&src, &ref)) goto done;
    {
        long long n = src.len / 4;
        const u32a *x = src.buf, *f = ref.buf;
        u32a *o = out.buf;
        BEGIN_MAYBE(n * 4)
        exp_ref_run(x, o, f, n, sign);
        END_MAYBE
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    PyBuffer_Release(&src); PyBuffer_Release(&out); PyBuffer_Release(&ref);
    return ret;
}

#define HIST_FLUSH (1LL << 30) /* words per flush of the uint32 sub-histograms */

static void hist_flush(int64_t *h, uint32_t (*q)[8][256], int w) {
    for (int u = 0; u < 4; u++) {
        for (int k = 0; k < w; k++)
            for (int v = 0; v < 256; v++) h[k * 256 + v] += q[u][k][v];
        memset(q[u], 0, (size_t)w * sizeof q[u][0]);
    }
}

#define CLOG_N 4096
static double clog_tab[CLOG_N]; /* c * log2(c), filled when the module loads */

/* Order-0 entropy (bits) of each of the w byte planes of the words b[st[i]:+run] (i < ns), the
 * byteplane rotation applied, into ent[0..w); runs without the GIL (the caller checked the runs). */
static void entropy_core(const uint8_t *b, int w, const int64_t *st, long long ns, long long run, double *ent) {
    int64_t h[8 * 256];
    double total = (double)(ns * run);
    memset(h, 0, sizeof(h));
    /* four histograms per plane, for words j % 4: a plane of few distinct values (exponents)
     * otherwise increments one counter back to back, each increment waiting for the last
     * (uint32 counts, flushed into h before they could overflow) */
    uint32_t q[4][8][256];
    for (int u = 0; u < 4; u++) memset(q[u], 0, (size_t)w * sizeof q[u][0]);
    long long pending = 0;
    for (long long i = 0; i < ns; i++) {
        const uint8_t *p = b + st[i] * w;
        for (long long j0 = 0; j0 < run; j0 += HIST_FLUSH) {
            long long j1 = run - j0 < HIST_FLUSH ? run : j0 + HIST_FLUSH, j = j0;
            if (w == 4) {
                for (; j + 4 <= j1; j += 4) {
                    for (int u = 0; u < 4; u++) {
                        uint32_t a;
                        memcpy(&a, p + 4 * (j + u), 4);
                        a = (a << 1) | (a >> 31);
                        q[u][0][a & 0xFF]++; q[u][1][(a >> 8) & 0xFF]++; q[u][2][(a >> 16) & 0xFF]++; q[u][3][a >> 24]++;
                    }
                }
            } else if (w == 2) {
                for (; j + 4 <= j1; j += 4) {
                    for (int u = 0; u < 4; u++) {
                        uint16_t a;
                        memcpy(&a, p + 2 * (j + u), 2);
                        a = (uint16_t)((a << 1) | (a >> 15));
                        q[u][0][a & 0xFF]++; q[u][1][a >> 8]++;
                    }
                }
            }
            for (; j < j1; j++) { /* (8-byte words, and the tail of a run) */
                uint64_t a = 0;
                memcpy(&a, p + (size_t)w * j, (size_t)w);
                a = (a << 1) | (a >> (8 * w - 1));
                for (int k = 0; k < w; k++) q[0][k][(a >> (8 * k)) & 0xFF]++;
            }
            pending += j1 - j0;
            if (pending >= HIST_FLUSH) {
                hist_flush(h, q, w);
                pending = 0;
            }
        }
    }
    hist_flush(h, q, w);
    /* order-0 entropy: log2(total) - sum(c log2 c) / total, c log2 c from a table for the
     * small counts of a sample's mantissa planes (a log2 per bin was a third of the time) */
    for (int k = 0; k < w; k++) {
        double sum = 0;
        for (int v = 0; v < 256; v++) {
            int64_t c = h[k * 256 + v];
            if (c) sum += c < CLOG_N ? clog_tab[c] : (double)c * log2((double)c);
        }
        double e = total > 0 ? log2(total) - sum / total : 0;
        ent[k] = e > 0 ? e : 0;
    }
}

static PyObject *py_plane_entropy(PyObject *self, PyObject *args) {
    Py_buffer src = {0}, bits = {0}, starts = {0};
    int w;
    long long run;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*iy*L", &src, &bits, &w, &starts, &run)) return NULL;
    PyObject *ret = NULL;
    int64_t *st = NULL;
    if ((w != 2 && w != 4 && w != 8) || bits.len != (Py_ssize_t)(w * 8) || starts.len % 8 || run < 1) {
        PyErr_SetString(PyExc_ValueError, "plane_entropy: width 2, 4 or 8, a float64 output per plane, run >= 1");
        goto done;
    }
    long long n = src.len / w, ns = starts.len / 8, words;
    st = PyMem_Malloc((size_t)(ns + 1) * sizeof(int64_t));  /* checked once, used as checked */
    if (!st) { PyErr_NoMemory(); goto done; }
    memcpy(st, starts.buf, (size_t)starts.len);
    for (long long i = 0; i < ns; i++) {
        if (st[i] < 0 || st[i] > n - run) {
            PyErr_SetString(PyExc_ValueError, "plane_entropy: run outside the buffer");
            goto done;
        }
    }
    if (__builtin_mul_overflow(ns, run, &words)) {
        PyErr_SetString(PyExc_ValueError, "plane_entropy: sample too large");
        goto done;
    }
    {
        double ent[8];
        BEGIN_MAYBE(words * w)
        entropy_core(src.buf, w, st, ns, run, ent);
        END_MAYBE
        memcpy(bits.buf, ent, (size_t)w * sizeof(double));
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    PyMem_Free(st);
    PyBuffer_Release(&src); PyBuffer_Release(&bits); PyBuffer_Release(&starts);
    return ret;
}

/* top_entropy(src[, step]): the order-0 entropy (bits) of the top byte plane of the rotated
 * 4-byte words of src (the float32 exponent field, bits 23..30): what engine.refplan's exponent
 * predictors are chosen by, a histogram of one plane where plane_entropy makes four. With a step,
 * of the words' expgrid / expref residual (the step's word 0 is src's first word), made in a
 * small buffer: the candidate's sample needs no residual tensor. */
static PyObject *py_top_entropy(PyObject *self, PyObject *args) {
    Py_buffer src = {0};
    PyObject *po = Py_None;
    step_t step;
    memset(&step, 0, sizeof step);
    (void)self;
    if (!PyArg_ParseTuple(args, "y*|O", &src, &po)) return NULL;
    if (step_parse(po, &step, src.len / 4 * 4, NULL, 4)) {
        PyBuffer_Release(&src);
        step_release(&step);
        return NULL;
    }
    long long n = src.len / 4;
    double e = 0;
    {
        BEGIN_MAYBE(src.len)
        int64_t h[256] = {0};
        if (step.kind) { /* the words' residual through the step, a buffer at a time, then counted */
            const u32a *x = src.buf;
            uint32_t tmp[PRE_SEG];
            for (long long j0 = 0; j0 < n; j0 += PRE_SEG) {
                long long k = n - j0 < PRE_SEG ? n - j0 : PRE_SEG;
                step_run(&step, x + j0, (u32a *)tmp, j0, k, -1);
                for (long long j = 0; j < k; j++) h[(tmp[j] >> 23) & 0xFF]++;
            }
        } else {
            const uint8_t *b = src.buf;
            uint32_t q[4][256];
            memset(q, 0, sizeof q);
            for (long long j0 = 0; j0 < n; j0 += HIST_FLUSH) {
                long long j1 = n - j0 < HIST_FLUSH ? n : j0 + HIST_FLUSH, j = j0;
                for (; j + 4 <= j1; j += 4)
                    for (int u = 0; u < 4; u++) q[u][(b[4 * (j + u) + 3] << 1 | b[4 * (j + u) + 2] >> 7) & 0xFF]++;
                for (; j < j1; j++) q[0][(b[4 * j + 3] << 1 | b[4 * j + 2] >> 7) & 0xFF]++;
                for (int u = 0; u < 4; u++) {
                    for (int v = 0; v < 256; v++) h[v] += q[u][v];
                    memset(q[u], 0, sizeof q[u]);
                }
            }
        }
        double sum = 0;
        for (int v = 0; v < 256; v++) {
            int64_t c = h[v];
            if (c) sum += c < CLOG_N ? clog_tab[c] : (double)c * log2((double)c);
        }
        e = n > 0 ? log2((double)n) - sum / (double)n : 0;
        END_MAYBE
    }
    PyBuffer_Release(&src);
    step_release(&step);
    return PyFloat_FromDouble(e > 0 ? e : 0.0);
}

/* plane_entropy_many(srcs, widths, bits, run): plane_entropy of each buffer srcs[i] (a sequence
 * of buffers of whole words of widths[i] bytes, int64) over 4 runs of `run` words at words
 * k * (n - run) / 3 (k < 4, n its words), the estimate of engine.planner.cpu_raw_planes, into
 * bits[8 i:8 i + widths[i]] (float64); a buffer of fewer than 4 runs gets -1 for every plane.
 * All of them in one call without the GIL: a save's planning thread holds the GIL, so a call per
 * storage from a pool thread waited for it each time. */
static PyObject *py_plane_entropy_many(PyObject *self, PyObject *args) {
    PyObject *seq_in, *seq = NULL, *ret = NULL;
    Py_buffer wb = {0}, bits = {0}, *bufs = NULL;
    int64_t *ws = NULL;
    long long run;
    Py_ssize_t n = 0, got = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oy*w*L", &seq_in, &wb, &bits, &run)) return NULL;
    if (!(seq = PySequence_Tuple(seq_in))) goto done;  /* (a tuple: its length cannot change) */
    n = PyTuple_GET_SIZE(seq);
    if (run < 1 || run > (1LL << 30) || wb.len != (Py_ssize_t)(8 * n) || bits.len != (Py_ssize_t)(64 * n)) {
        PyErr_SetString(PyExc_ValueError, "plane_entropy_many: an int64 width and 8 float64 outputs per buffer, 1 <= run <= 2**30");
        goto done;
    }
    /* the widths copied once and checked: what is checked is what is used without the GIL (the
     * caller's buffer may overlap the output, or change) */
    if (!(bufs = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer))) || !(ws = PyMem_Malloc((size_t)n * 8 + 8))) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(ws, wb.buf, (size_t)n * 8);
    for (got = 0; got < n; got++) {
        if (ws[got] != 2 && ws[got] != 4 && ws[got] != 8) {
            PyErr_SetString(PyExc_ValueError, "plane_entropy_many: width 2, 4 or 8");
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, got), &bufs[got], PyBUF_SIMPLE)) goto done;
    }
    {
        char *out = bits.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            int w = (int)ws[i];
            long long words = bufs[i].len / w;
            double ent[8];
            for (int k = 0; k < 8; k++) ent[k] = -1;
            if (words >= 4 * run) {
                int64_t st[4];
                for (int k = 0; k < 4; k++) st[k] = k * (words - run) / 3;
                entropy_core(bufs[i].buf, w, st, 4, run, ent);
            }
            memcpy(out + 64 * i, ent, sizeof ent);
        }
        Py_END_ALLOW_THREADS
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(ws);
    Py_XDECREF(seq);
    PyBuffer_Release(&wb); PyBuffer_Release(&bits);
    return ret;
}

/* -- zstd frames through the system's libzstd ------------------------------------------------
 * Loaded with dlopen on first use (no headers or link-time dependency: the prototypes below are
 * libzstd's stable API since 1.3). Decoding one frame into a flat buffer of known capacity needs
 * no window buffer: memory is one decoding context per call, whatever the frame header says. */
typedef struct ZSTD_DCtx_s ZSTD_DCtx;
static struct {
    int tried;
    unsigned version;
    ZSTD_DCtx *(*create)(void);
    size_t (*free_)(ZSTD_DCtx *);
    size_t (*decompress)(ZSTD_DCtx *, void *, size_t, const void *, size_t);
    unsigned (*is_error)(size_t);
    const char *(*error_name)(size_t);
    unsigned long long (*content_size)(const void *, size_t);
    size_t (*frame_size)(const void *, size_t);
} zs;

#define ZSTD_MIN_VERSION 10400 /* 1.4.0 */

static unsigned zstd_load(void) { /* called with the GIL held */
    if (zs.tried) return zs.version;
    zs.tried = 1;
    void *h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return 0;
    unsigned (*version)(void) = (unsigned (*)(void))dlsym(h, "ZSTD_versionNumber");
    zs.create = (ZSTD_DCtx * (*)(void)) dlsym(h, "ZSTD_createDCtx");
    zs.free_ = (size_t(*)(ZSTD_DCtx *))dlsym(h, "ZSTD_freeDCtx");
    zs.decompress = (size_t(*)(ZSTD_DCtx *, void *, size_t, const void *, size_t))dlsym(h, "ZSTD_decompressDCtx");
    zs.is_error = (unsigned (*)(size_t))dlsym(h, "ZSTD_isError");
    zs.error_name = (const char *(*)(size_t))dlsym(h, "ZSTD_getErrorName");
    zs.content_size = (unsigned long long (*)(const void *, size_t))dlsym(h, "ZSTD_getFrameContentSize");
    zs.frame_size = (size_t(*)(const void *, size_t))dlsym(h, "ZSTD_findFrameCompressedSize");
    if (!version || !zs.create || !zs.free_ || !zs.decompress || !zs.is_error || !zs.error_name ||
        !zs.content_size || !zs.frame_size || version() < ZSTD_MIN_VERSION) {
        dlclose(h);
        return 0;
    }
    zs.version = version();
    return zs.version;
}

static PyObject *py_zstd_version(PyObject *self, PyObject *args) {
    (void)self; (void)args;
    return PyLong_FromUnsignedLong(zstd_load());
}

#define ZSTD_UNKNOWN (0ULL - 1)

/* Decode the chunk in[0:len], which must be exactly one standard zstd frame of exactly `want`
 * bytes, into out (room for want bytes). 0, or -1 with the reason in msg. A standard frame's
 * magic is checked first: libzstd also decodes legacy (v0.5, v0.6) and skippable frames, which
 * are not this format's chunks. Called without the GIL. */
static int decode_frame(ZSTD_DCtx *dc, const char *in, size_t len, void *out, size_t want, char *msg, size_t cap) {
    int magic = len >= 4 && (unsigned char)in[0] == 0x28 && (unsigned char)in[1] == 0xB5 &&
                (unsigned char)in[2] == 0x2F && (unsigned char)in[3] == 0xFD;
    unsigned long long declared = magic ? zs.content_size(in, len) : ZSTD_UNKNOWN - 1;
    size_t fsz = magic ? zs.frame_size(in, len) : 0;
    if (!magic || declared == ZSTD_UNKNOWN - 1 || zs.is_error(fsz)) {
        snprintf(msg, cap, "is not a zstd frame");
    } else if (declared != ZSTD_UNKNOWN && declared != (unsigned long long)want) {
        snprintf(msg, cap, "declares %llu bytes, the chunk table %zu", declared, want);
    } else if (fsz != len) {
        snprintf(msg, cap, "is not exactly one zstd frame");
    } else {
        size_t got = zs.decompress(dc, out, want, in, len);
        if (zs.is_error(got))
            snprintf(msg, cap, "does not decode: %s", zs.error_name(got));
        else if (got != want)
            snprintf(msg, cap, "decodes to %zu bytes, the chunk table %zu", got, want);
    }
    return msg[0] ? -1 : 0;
}

/* The checks of a call over chunks src[so[i]:+ss[i]] -> dst[dof[i]:+ds[i]] before anything is
 * done: the buffers do not overlap, every chunk lies inside its buffer. 0, or -1 with ValueError. */
static int check_chunks(const char *name, const Py_buffer *src, const Py_buffer *dst, const int64_t *so,
                        const int64_t *ss, const int64_t *dof, const int64_t *ds, Py_ssize_t n) {
    if (overlap(src, dst)) {
        PyErr_Format(PyExc_ValueError, "%s: source and destination buffers overlap", name);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (so[i] < 0 || ss[i] < 0 || dof[i] < 0 || ds[i] < 0 || so[i] > src->len - ss[i] ||
            dof[i] > dst->len - ds[i]) {
            PyErr_SetString(PyExc_ValueError, "chunk outside its buffer");
            return -1;
        }
    }
    return 0;
}

/* The end of a call over chunks: NULL after a failed allocation, (index, message) of the first
 * chunk that failed (msg non-empty), or None. */
static PyObject *chunks_result(int no_memory, const char *msg, Py_ssize_t bad) {
    if (no_memory) return PyErr_NoMemory();
    if (msg[0]) return Py_BuildValue("(ns)", bad, msg);
    Py_RETURN_NONE;
}

static PyObject *py_zstd_decode(PyObject *self, PyObject *args) {
    Py_buffer b[6] = {{0}}, *src = &b[0], *dst = &b[1], *tb = b + 2;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*y*y*y*y*", src, dst, &tb[0], &tb[1], &tb[2], &tb[3])) return NULL;
    PyObject *ret = NULL;
    int64_t *t = NULL;
    Py_ssize_t n = 0;
    if (!zstd_load()) {
        PyErr_SetString(PyExc_RuntimeError, "libzstd.so.1 (1.4 or later) was not found");
        goto done;
    }
    if (!(t = copy_tables(tb, 4, &n))) goto done;
    const int64_t *so = t, *ss = t + n, *dof = t + 2 * n, *ds = t + 3 * n;
    if (check_chunks("zstd_decode", src, dst, so, ss, dof, ds, n)) goto done;
    {
        char msg[200] = {0};
        Py_ssize_t bad = -1;
        int no_memory = 0;
        const char *sb = src->buf;
        char *db = dst->buf;
        Py_BEGIN_ALLOW_THREADS
        ZSTD_DCtx *dc = zs.create();
        no_memory = !dc;
        for (Py_ssize_t i = 0; dc && i < n && !msg[0]; i++) {
            if (decode_frame(dc, sb + so[i], (size_t)ss[i], db + dof[i], (size_t)ds[i], msg, sizeof msg)) bad = i;
        }
        if (dc) zs.free_(dc);
        Py_END_ALLOW_THREADS
        ret = chunks_result(no_memory, msg, bad);
    }
done:
    return finish(ret, t, b, 6);
}

/* A decoding context and scratch memory kept per thread (the CPU pool's threads live as long as
 * the process): a call over one small storage otherwise spent more in ZSTD_createDCtx and in
 * the page faults of a new scratch buffer than in decoding. Scratch over SCRATCH_KEEP bytes is
 * not kept (the writer's layout needs one or two 1 MiB chunks per thread; a pool of 16 threads
 * then keeps 64 MiB at most). Both are freed when their thread exits (a pthread key's
 * destructor: a caller's own short-lived threads decode small batches inline). */
#define SCRATCH_KEEP (4LL << 20)
typedef struct { ZSTD_DCtx *dc; uint8_t *buf; size_t len; } tl_t;
static pthread_key_t tl_key;
static pthread_once_t tl_once = PTHREAD_ONCE_INIT;
static int tl_ok;

static void tl_free(void *p) {
    tl_t *t = p;
    if (!t) return;
    if (t->dc) zs.free_(t->dc);
    free(t->buf);
    free(t);
}

static void tl_init(void) { tl_ok = pthread_key_create(&tl_key, tl_free) == 0; }

static tl_t *tl_get(void) { /* NULL: nothing is kept (the caller allocates and frees) */
    pthread_once(&tl_once, tl_init);
    if (!tl_ok) return NULL;
    tl_t *t = pthread_getspecific(tl_key);
    if (!t && (t = calloc(1, sizeof *t)) && pthread_setspecific(tl_key, t)) {
        free(t);
        t = NULL;
    }
    return t;
}

static ZSTD_DCtx *dctx_take(int *own) { /* NULL: out of memory */
    tl_t *t = tl_get();
    *own = !t;
    if (!t) return zs.create();
    if (!t->dc) t->dc = zs.create();
    return t->dc;
}

static void dctx_give(ZSTD_DCtx *dc, int own) {
    if (own && dc) zs.free_(dc);
}

static uint8_t *scratch_take(size_t n, int *own) { /* NULL: out of memory */
    tl_t *t = n <= (size_t)SCRATCH_KEEP ? tl_get() : NULL;
    *own = !t;
    if (!t) return malloc(n ? n : 1);
    if (t->len < n) {
        free(t->buf);
        t->len = 0;
        if (!(t->buf = malloc(n))) return NULL;
        t->len = n;
    }
    return t->buf;
}

/* -- XXH3-64 from the xxhash package's extension --------------------------------------------
 * The checksum of every chunk (docs/format.md) is XXH3-64 with seed 0. python-xxhash, a
 * dependency, links libxxhash into its extension and exports its C API; taking the function from
 * there (dlopen RTLD_NOLOAD: only an object Python has loaded already) lets chunks be verified in
 * C, on the decoding threads, with no second copy of the hash. */
typedef uint64_t (*xxh3_fn)(const void *, size_t);
static xxh3_fn xxh3_64;

static PyObject *py_xxh3_load(PyObject *self, PyObject *args) {
    const char *path;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (!xxh3_64) {
        void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
        if (h) {  /* the build's runtime dispatch (AVX2 / AVX-512 where the CPU has them), where
                   * exported; else the plain function (SSE2 on x86-64: about twice the instructions) */
            xxh3_64 = (xxh3_fn)dlsym(h, "XXH3_64bits_dispatch");
            if (!xxh3_64) xxh3_64 = (xxh3_fn)dlsym(h, "XXH3_64bits");
        }
    }
    return PyBool_FromLong(xxh3_64 != NULL);
}

static PyObject *py_xxh3_many(PyObject *self, PyObject *args) {
    Py_buffer b[4] = {{0}}, *buf = &b[0], *tb = b + 1, *out = &b[3];
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", buf, &tb[0], &tb[1], out)) return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = 0;
    int64_t *t = NULL;
    if (!xxh3_64) {
        PyErr_SetString(PyExc_RuntimeError, "xxh3_many: XXH3 is not loaded (xxh3_load)");
        goto done;
    }
    if (!(t = copy_tables(tb, 2, &n))) goto done;
    if (out->len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "xxh3_many: out must hold one uint64 per chunk");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (t[i] < 0 || t[n + i] < 0 || t[i] > buf->len - t[n + i]) {
            PyErr_SetString(PyExc_ValueError, "xxh3_many: chunk outside the buffer");
            goto done;
        }
    }
    {
        const uint8_t *s = buf->buf;
        u64a *o = out->buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) o[i] = xxh3_64(s + t[i], (size_t)t[n + i]);
        Py_END_ALLOW_THREADS
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    return finish(ret, t, b, 4);
}

/* planes_fused(src, dst, width, planes, words0, words, soffs, ssizes, w0, w1): words w0..w1 of
 * dst (words of `width` bytes, the byteplane rotation undone) straight from their byte planes'
 * chunks, in one pass over dst. Chunk i holds words words0[i]..+words[i] of plane
 * planes[i] % 256; its kind is planes[i] / 256. Kind 0: stored as is at src[soffs[i]:+ssizes[i]] (ssizes[i] == words[i]), read
 * where it lies; kind 1: one zstd frame there that decodes to exactly words[i] bytes, decoded
 * into a scratch buffer of its plane (at most FUSED_MAX_CHUNK bytes, so cache-sized for the
 * writer's chunks) just before its words are assembled. Every plane's chunks must cover
 * 0..len(dst)/width in table order, without gaps or overlaps. With xxh3 (a uint64 per chunk, the
 * chunk table's checksums) every chunk holding any of the words w0..w1 (those this call reads;
 * callers cut pieces where every plane's chunks start, so each chunk is verified once) is
 * verified before anything is decoded. Returns None, or (index, message) of the first chunk that failed (message
 * "checksum" for a chunk whose XXH3 differs); src and dst must not overlap. */
#define FUSED_MAX_CHUNK (16LL << 20)

/* One planes_fused call's checked inputs (the tables a private copy): see fused_check. */
typedef struct {
    Py_buffer dst, tb[5], xb;
    int w;
    long long w0, w1;
    int64_t *t;
    uint64_t *want;
    Py_ssize_t n, *idx, start[9];
    long long most[8];
    int coded;
    step_t post; /* planes_fused_many's post step on the piece's words, in place (kind 0: none) */
    PyObject *post_obj;
} fused_t;

static void fused_free(fused_t *f) {
    PyMem_Free(f->idx);
    PyMem_Free(f->want);
    PyMem_Free(f->t);
    f->idx = NULL;
    f->want = NULL;
    f->t = NULL;
    PyBuffer_Release(&f->dst);
    for (int k = 0; k < 5; k++) PyBuffer_Release(&f->tb[k]);
    PyBuffer_Release(&f->xb);
    step_release(&f->post);
}

/* Check a call's inputs against src (with the GIL): 0, or -1 with a Python exception set. */
static int fused_check(fused_t *f, const Py_buffer *src) {
    int w = f->w;
    long long w0 = f->w0, w1 = f->w1;
    const Py_buffer *dst = &f->dst;
    if (w != 2 && w != 4 && w != 8) {
        PyErr_SetString(PyExc_ValueError, "width must be 2, 4 or 8");
        return -1;
    }
    if (dst->len % w) {
        PyErr_SetString(PyExc_ValueError, "dst must hold whole words");
        return -1;
    }
    long long nw = dst->len / w;
    if (w0 < 0 || w1 < w0 || w1 > nw) {
        PyErr_SetString(PyExc_ValueError, "word range outside dst");
        return -1;
    }
    if (overlap(src, dst)) {
        PyErr_SetString(PyExc_ValueError, "planes_fused: source and destination buffers overlap");
        return -1;
    }
    if (!(f->t = copy_tables(f->tb, 5, &f->n))) return -1;
    Py_ssize_t n = f->n;
    const int64_t *pl = f->t, *ws = f->t + n, *wn = f->t + 2 * n, *so = f->t + 3 * n, *ss = f->t + 4 * n;
    if (f->xb.obj) { /* (a private copy, as the tables) */
        if (f->xb.len != n * 8) {
            PyErr_SetString(PyExc_ValueError, "planes_fused: xxh3 must hold one uint64 per chunk");
            return -1;
        }
        if (!xxh3_64) {
            PyErr_SetString(PyExc_RuntimeError, "planes_fused: XXH3 is not loaded (xxh3_load)");
            return -1;
        }
        if (!(f->want = PyMem_Malloc((size_t)(n + 1) * 8))) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(f->want, f->xb.buf, (size_t)f->xb.len);
    }
    /* every chunk inside its buffers, every plane's chunks tiling the words in table order */
    long long covered[8] = {0};
    for (int k = 0; k < 8; k++) f->most[k] = 0;
    f->coded = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k = pl[i] & 0xFF, kind = pl[i] >> 8;
        if (pl[i] < 0 || k >= w || kind > 1 || wn[i] <= 0 || ws[i] != covered[k] || wn[i] > nw - ws[i] ||
            so[i] < 0 || ss[i] < 0 || so[i] > src->len - ss[i] || (kind == 0 && ss[i] != wn[i]) ||
            (kind == 1 && wn[i] > FUSED_MAX_CHUNK)) {
            PyErr_SetString(PyExc_ValueError, "planes_fused: chunk outside its buffers or out of order");
            return -1;
        }
        covered[k] += wn[i];
        if (kind == 1 && ws[i] < w1 && ws[i] + wn[i] > w0) { /* (scratch for this call's words only) */
            f->coded = 1;
            if (wn[i] > f->most[k]) f->most[k] = wn[i];
        }
    }
    for (int k = 0; k < w; k++) {
        if (covered[k] != nw) {
            PyErr_SetString(PyExc_ValueError, "planes_fused: a plane's chunks do not cover dst");
            return -1;
        }
    }
    if (f->coded && !zstd_load()) {
        PyErr_SetString(PyExc_RuntimeError, "libzstd.so.1 (1.4 or later) was not found");
        return -1;
    }
    /* each plane's chunk rows, in order */
    if (!(f->idx = PyMem_Malloc((size_t)(n + 1) * sizeof(Py_ssize_t)))) {
        PyErr_NoMemory();
        return -1;
    }
    for (int k = 0; k < 9; k++) f->start[k] = 0;
    for (Py_ssize_t i = 0; i < n; i++) f->start[(pl[i] & 0xFF) + 1]++;
    for (int k = 0; k < w; k++) f->start[k + 1] += f->start[k];
    Py_ssize_t fill[8];
    for (int k = 0; k < w; k++) fill[k] = f->start[k];
    for (Py_ssize_t i = 0; i < n; i++) f->idx[fill[pl[i] & 0xFF]++] = i;
    if (f->post_obj && step_parse(f->post_obj, &f->post, dst->len, dst, w)) return -1;
    return 0;
}

/* Decode a checked call (without the GIL): sets msg and *bad (the chunk) on a failure, or
 * *no_memory. */
static void fused_run(const fused_t *f, const uint8_t *sb, char *msg, size_t cap, Py_ssize_t *bad,
                      int *no_memory) {
    int w = f->w;
    long long w0 = f->w0, w1 = f->w1;
    Py_ssize_t n = f->n;
    const int64_t *pl = f->t, *ws = f->t + n, *wn = f->t + 2 * n, *so = f->t + 3 * n, *ss = f->t + 4 * n;
    const Py_ssize_t *idx = f->idx;
    uint8_t *db = f->dst.buf;
    for (Py_ssize_t i = 0; f->want && i < n && !msg[0]; i++) { /* (every chunk the range reads) */
        if (ws[i] < w1 && ws[i] + wn[i] > w0 && xxh3_64(sb + so[i], (size_t)ss[i]) != f->want[i]) {
            *bad = i;
            snprintf(msg, cap, "checksum");
        }
    }
    uint8_t *scratch[8] = {0}, *mem = NULL;
    Py_ssize_t cur[8], have[8];
    size_t need = 0;
    for (int k = 0; k < w; k++) need += (size_t)f->most[k];
    int own_dc = 0, own_mem = 0;
    int decode = f->coded && !msg[0]; /* (nothing is decoded after a checksum failure) */
    ZSTD_DCtx *dc = decode ? dctx_take(&own_dc) : NULL;
    if (decode) mem = scratch_take(need, &own_mem);
    *no_memory = decode && (!dc || !mem);
    uint8_t *base = mem;
    for (int k = 0; k < w; k++) {
        have[k] = -1;
        cur[k] = f->start[k];
        scratch[k] = mem;
        if (mem) mem += f->most[k];
    }
    for (long long s = w0; s < w1 && !*no_memory && !msg[0];) {
        const uint8_t *pp[8] = {0}; /* (every one is set below; gcc 13 cannot tell) */
        long long e = w1;
        for (int k = 0; k < w && !msg[0]; k++) {
            Py_ssize_t i = idx[cur[k]];
            while (ws[i] + wn[i] <= s) i = idx[++cur[k]]; /* (the chunks cover every word) */
            if (pl[i] >> 8 == 0) {
                pp[k] = sb + so[i] + (s - ws[i]);
            } else {
                if (have[k] != i) {
                    if (decode_frame(dc, (const char *)sb + so[i], (size_t)ss[i], scratch[k], (size_t)wn[i], msg,
                                     cap)) {
                        *bad = i;
                        break;
                    }
                    have[k] = i;
                }
                pp[k] = scratch[k] + (s - ws[i]);
            }
            if (ws[i] + wn[i] < e) e = ws[i] + wn[i];
        }
        if (msg[0]) break;
        dec_ptrs(pp, db + s * w, NULL, 0, w, 0, e - s);
        s = e;
    }
    if (own_mem) free(base);
    dctx_give(dc, own_dc);
    if (f->post.kind && !msg[0] && !*no_memory) { /* (on the piece's words while they are in the cache) */
        long long p0 = w0 * w / 4;
        step_run(&f->post, (u32a *)db + p0, (u32a *)db + p0, p0, (w1 - w0) * w / 4, 1);
    }
}

static PyObject *py_planes_fused(PyObject *self, PyObject *args) {
    Py_buffer src = {0};
    fused_t f;
    memset(&f, 0, sizeof f);
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*iy*y*y*y*y*LL|y*", &src, &f.dst, &f.w, &f.tb[0], &f.tb[1], &f.tb[2], &f.tb[3],
                          &f.tb[4], &f.w0, &f.w1, &f.xb))
        return NULL;
    PyObject *ret = NULL;
    if (fused_check(&f, &src) == 0) {
        char msg[200] = {0};
        Py_ssize_t bad = -1;
        int no_memory = 0;
        Py_BEGIN_ALLOW_THREADS
        fused_run(&f, src.buf, msg, sizeof msg, &bad, &no_memory);
        Py_END_ALLOW_THREADS
        ret = chunks_result(no_memory, msg, bad);
    }
    fused_free(&f);
    PyBuffer_Release(&src);
    return ret;
}

/* planes_fused_many(src, items, order, counter): many planes_fused calls over one source, each
 * item a tuple of planes_fused's other arguments (dst, width, planes, words0, words, soffs,
 * ssizes, w0, w1, xxh3 or None[, post]), every one checked first; post, a step on each piece's
 * words once decoded (in place, in the cache): ("grid", r, c, g0), expgrid's inverse with the
 * int32 terms r, c for dst's words from grid word g0, or ("ref", words), expref's inverse against
 * the reference words beside dst's. Then, without the GIL, the calling
 * thread takes items in the order `order` (int64, a permutation of the items) from the shared
 * position counter[0] (int64, atomically incremented: several threads calling with the same
 * items, order and counter share the work) until none is left or one fails. Returns None, or
 * (item, chunk, message) of this thread's failure; counter[1] is set to 1 on a failure so that
 * the other threads stop taking items. */
static PyObject *py_planes_fused_many(PyObject *self, PyObject *args) {
    Py_buffer src = {0}, ob = {0}, cb = {0};
    PyObject *list, *items = NULL, *ret = NULL;
    int64_t *order = NULL;
    char *seen = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O!y*w*", &src, &PyList_Type, &list, &ob, &cb)) return NULL;
    /* (a tuple of the items: parsing them runs Python code that could change the list) */
    Py_ssize_t m = 0, got = 0;
    fused_t *fs = NULL;
    if (!(items = PySequence_Tuple(list))) goto done;
    m = PyTuple_GET_SIZE(items);
    fs = PyMem_Calloc((size_t)m + 1, sizeof(fused_t));
    order = PyMem_Malloc((size_t)m * 8 + 8);
    seen = PyMem_Calloc((size_t)m + 1, 1);
    if (!fs || !order || !seen) {
        PyErr_NoMemory();
        goto done;
    }
    if (ob.len != m * 8 || cb.len < 16 || ((uintptr_t)cb.buf % 8) || ((const int64_t *)cb.buf)[0] < 0) {
        PyErr_SetString(PyExc_ValueError, "planes_fused_many: order must hold one int64 per item, counter two "
                                          "(the first not negative)");
        goto done;
    }
    memcpy(order, ob.buf, (size_t)ob.len); /* (what is checked is what is used) */
    for (Py_ssize_t j = 0; j < m; j++) {
        if (order[j] < 0 || order[j] >= m || seen[order[j]]) {
            PyErr_SetString(PyExc_ValueError, "planes_fused_many: order is not a permutation of the items");
            goto done;
        }
        seen[order[j]] = 1;
    }
    for (; got < m; got++) {
        fused_t *f = &fs[got];
        PyObject *it = PyTuple_GET_ITEM(items, got), *xo = Py_None, *po = Py_None;
        if (!PyTuple_Check(it) || !PyArg_ParseTuple(it, "w*iy*y*y*y*y*LLO|O", &f->dst, &f->w, &f->tb[0], &f->tb[1],
                                                    &f->tb[2], &f->tb[3], &f->tb[4], &f->w0, &f->w1, &xo, &po)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "planes_fused_many: items must be tuples");
            got++; /* (release what the parse took) */
            goto done;
        }
        if (xo != Py_None && PyObject_GetBuffer(xo, &f->xb, PyBUF_SIMPLE) < 0) {
            got++;
            goto done;
        }
        f->post_obj = po != Py_None ? po : NULL; /* (parsed by fused_check; the items tuple holds it) */
        if (fused_check(f, &src) < 0) {
            got++;
            goto done;
        }
    }
    {
        char msg[200] = {0};
        Py_ssize_t bad = -1, which = -1;
        int no_memory = 0;
        int64_t *counter = cb.buf;
        const uint8_t *sb = src.buf;
        Py_BEGIN_ALLOW_THREADS
        for (;;) {
            if (__atomic_load_n(&counter[1], __ATOMIC_ACQUIRE)) break;
            int64_t j = __atomic_fetch_add(&counter[0], 1, __ATOMIC_ACQ_REL);
            if (j < 0 || j >= m) break; /* (the caller's counter: never trusted as an index) */
            which = (Py_ssize_t)order[j];
            fused_run(&fs[which], sb, msg, sizeof msg, &bad, &no_memory);
            if (msg[0] || no_memory) {
                __atomic_store_n(&counter[1], 1, __ATOMIC_RELEASE);
                break;
            }
        }
        Py_END_ALLOW_THREADS
        if (no_memory)
            PyErr_NoMemory();
        else if (msg[0])
            ret = Py_BuildValue("(nns)", which, bad, msg);
        else {
            ret = Py_None;
            Py_INCREF(ret);
        }
    }
done:
    if (fs) {
        for (Py_ssize_t j = 0; j < got; j++) fused_free(&fs[j]);
        PyMem_Free(fs);
    }
    PyMem_Free(order);
    PyMem_Free(seen);
    Py_XDECREF(items);
    PyBuffer_Release(&src);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&cb);
    return ret;
}

/* zstd_encode(src, dst, soffs, ssizes, doffs, dcaps, osizes, params): every chunk
 * src[soffs[i]:+ssizes[i]] compressed as one zstd frame into dst[doffs[i]:+dcaps[i]] (int64
 * arrays), its size into osizes[i] (int64); params: int32 (parameter, value) pairs for
 * ZSTD_CCtx_setParameter, experimental ones included (literal compression forced on with the
 * fast strategy's acceleration: a fast-strategy frame whose literals are Huffman-coded, what
 * byte planes need). Returns None, or (index, message) of the first chunk that failed (-1: the
 * library refused a parameter). The compressor is loaded beside the decoder, on first use. */
typedef struct ZSTD_CCtx_s ZSTD_CCtx;
static struct {
    int tried, ok;
    ZSTD_CCtx *(*create)(void);
    size_t (*free_)(ZSTD_CCtx *);
    size_t (*set)(ZSTD_CCtx *, int, int);
    size_t (*compress2)(ZSTD_CCtx *, void *, size_t, const void *, size_t);
} zc;

static int zstd_load_c(void) { /* called with the GIL held */
    if (zc.tried) return zc.ok;
    zc.tried = 1;
    if (!zstd_load()) return 0;
    void *h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);  /* (the same handle, counted again) */
    if (!h) return 0;
    zc.create = (ZSTD_CCtx * (*)(void)) dlsym(h, "ZSTD_createCCtx");
    zc.free_ = (size_t(*)(ZSTD_CCtx *))dlsym(h, "ZSTD_freeCCtx");
    zc.set = (size_t(*)(ZSTD_CCtx *, int, int))dlsym(h, "ZSTD_CCtx_setParameter");
    zc.compress2 = (size_t(*)(ZSTD_CCtx *, void *, size_t, const void *, size_t))dlsym(h, "ZSTD_compress2");
    zc.ok = zc.create && zc.free_ && zc.set && zc.compress2;
    return zc.ok;
}

static PyObject *py_zstd_encode(PyObject *self, PyObject *args) {
    Py_buffer b[8] = {{0}}, *src = &b[0], *dst = &b[1], *tb = b + 2, *osz = &b[6], *par = &b[7];
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*y*y*y*y*w*y*", src, dst, &tb[0], &tb[1], &tb[2], &tb[3], osz, par)) return NULL;
    PyObject *ret = NULL;
    int64_t *t = NULL;
    Py_ssize_t n = 0;
    if (!zstd_load_c()) {
        PyErr_SetString(PyExc_RuntimeError, "libzstd.so.1 (1.4 or later, with its compressor) was not found");
        goto done;
    }
    if (!(t = copy_tables(tb, 4, &n))) goto done;
    if (osz->len != n * 8 || par->len % 8) {
        PyErr_SetString(PyExc_ValueError, "zstd_encode: output sizes or parameters of the wrong size");
        goto done;
    }
    const int64_t *so = t, *ss = t + n, *dof = t + 2 * n, *dc = t + 3 * n;
    if (check_chunks("zstd_encode", src, dst, so, ss, dof, dc, n)) goto done;
    {
        char msg[200] = {0};
        Py_ssize_t bad = -1;
        int no_memory = 0;
        const char *sb = src->buf;
        char *db = dst->buf;
        i64a *out = osz->buf;
        const int32_t *pp = par->buf;
        Py_ssize_t np_ = par->len / 8;
        Py_BEGIN_ALLOW_THREADS
        ZSTD_CCtx *cc = zc.create();
        no_memory = !cc;
        for (Py_ssize_t k = 0; cc && k < np_ && !msg[0]; k++) {
            size_t r = zc.set(cc, pp[2 * k], pp[2 * k + 1]);
            if (zs.is_error(r)) snprintf(msg, sizeof msg, "parameter %d = %d: %s", pp[2 * k], pp[2 * k + 1], zs.error_name(r));
        }
        for (Py_ssize_t i = 0; cc && i < n && !msg[0]; i++) {
            size_t got = zc.compress2(cc, db + dof[i], (size_t)dc[i], sb + so[i], (size_t)ss[i]);
            if (zs.is_error(got)) {
                snprintf(msg, sizeof msg, "does not compress: %s", zs.error_name(got));
                bad = i;
            } else {
                out[i] = (int64_t)got;
            }
        }
        if (cc) zc.free_(cc);
        Py_END_ALLOW_THREADS
        ret = chunks_result(no_memory, msg, bad);
    }
done:
    return finish(ret, t, b, 8);
}

/* -- file space ------------------------------------------------------------------------------
 * fs_type(fd): the file system's magic number (fstatfs f_type; 0 where unknown).
 * fallocate(fd, mode, offset, length): Linux fallocate(2) without the GIL (mode 1: KEEP_SIZE,
 * 3: PUNCH_HOLE | KEEP_SIZE); an OSError on failure. */
static PyObject *py_fs_type(PyObject *self, PyObject *args) {
    int fd;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
#if defined(__linux__)
    struct statfs sf;
    if (fstatfs(fd, &sf) == 0) return PyLong_FromUnsignedLong((unsigned long)sf.f_type);
#endif
    return PyLong_FromLong(0);
}

static PyObject *py_fallocate(PyObject *self, PyObject *args) {
    int fd, mode;
    long long off, len;
    (void)self;
    if (!PyArg_ParseTuple(args, "iiLL", &fd, &mode, &off, &len)) return NULL;
    if (off < 0 || len <= 0) {
        PyErr_SetString(PyExc_ValueError, "fallocate: offset must be >= 0 and length > 0");
        return NULL;
    }
#if defined(__linux__)
    int r, err = 0;
    Py_BEGIN_ALLOW_THREADS
    r = fallocate(fd, mode, (off_t)off, (off_t)len);
    if (r) err = errno;
    Py_END_ALLOW_THREADS
    if (r) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
#else
    errno = EOPNOTSUPP;
    return PyErr_SetFromErrno(PyExc_OSError);
#endif
}

/* -- huge pages for new host buffers ---------------------------------------------------------
 * A new anonymous buffer is filled through one page fault per 4 KiB page: 40 MB took 40 ms on
 * one core of a 2-core VM, 10.5 ms with 2 MiB pages. Only whole 2 MiB pages inside the buffer
 * are advised (the kernel splits the mapping there), so no page outside it changes. */
static PyObject *py_huge_pages(PyObject *self, PyObject *args) {
    Py_buffer b = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "w*", &b)) return NULL;
    long long done = 0;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t lo = ((uintptr_t)b.buf + huge - 1) & ~(huge - 1);
    uintptr_t hi = ((uintptr_t)b.buf + (uintptr_t)b.len) & ~(huge - 1);
    if (b.len > 0 && hi > lo && madvise((void *)lo, hi - lo, MADV_HUGEPAGE) == 0) done = (long long)(hi - lo);
#endif
    PyBuffer_Release(&b);
    return PyLong_FromLongLong(done);
}

/* derived's bfloat16 prediction of a float32 word: round to nearest even of the bits, NaN 0x7FC0 */
static inline uint16_t bf16_of(uint32_t u) {
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static PyObject *py_cast_bf16(PyObject *self, PyObject *args) {
    Py_buffer src = {0}, out = {0}, oth = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*|y*", &src, &out, &oth)) return NULL;
    const int has_other = PyTuple_GET_SIZE(args) > 2;
    PyObject *ret = NULL;
    if (src.len % 4 || out.len != src.len / 2 || (has_other && oth.len != out.len)) {
        PyErr_SetString(PyExc_ValueError, "cast_bf16: src must hold whole 4-byte words, out (and other) 2 bytes for each");
    } else if (overlap(&src, &out) || (has_other && oth.buf != out.buf && overlap(&oth, &out))) {
        PyErr_SetString(PyExc_ValueError, "cast_bf16: out overlaps src, or other without being out");
    } else {
        const u32a *x = (const u32a *)src.buf;
        const u16a *z = has_other ? (const u16a *)oth.buf : NULL;
        u16a *y = (u16a *)out.buf;
        Py_ssize_t n = src.len / 4;
        BEGIN_MAYBE(src.len)
        if (z)
            for (Py_ssize_t i = 0; i < n; i++) y[i] = (uint16_t)(bf16_of(x[i]) ^ z[i]);
        else
            for (Py_ssize_t i = 0; i < n; i++) y[i] = bf16_of(x[i]);
        END_MAYBE
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    if (has_other) PyBuffer_Release(&oth);
    return ret;
}

static PyObject *py_cast_bf16_diff(PyObject *self, PyObject *args) {
    Py_buffer src = {0}, tgt = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*", &src, &tgt)) return NULL;
    PyObject *ret = NULL;
    if (src.len % 4 || tgt.len != src.len / 2) {
        PyErr_SetString(PyExc_ValueError, "cast_bf16_diff: src must hold whole 4-byte words, tgt 2 bytes for each");
    } else {
        const u32a *x = (const u32a *)src.buf;
        const u16a *y = (const u16a *)tgt.buf;
        Py_ssize_t n = src.len / 4;
        long long diff = 0;
        BEGIN_MAYBE(src.len)
        for (Py_ssize_t i = 0; i < n; i++) diff += bf16_of(x[i]) != y[i];
        END_MAYBE
        ret = PyLong_FromLongLong(diff);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&tgt);
    return ret;
}

/* -- parallel reads ------------------------------------------------------------------------- */
typedef struct {
    int fd;
    char *buf;
    const int64_t *fo, *bo, *ln;
    Py_ssize_t n;
    Py_ssize_t next;     /* the next range to take (atomic) */
    int err;             /* first errno seen, or 0 (atomic) */
    int64_t short_at;    /* file offset where the file ended inside a range, or -1 (atomic min) */
} reads_t;

static void *read_worker(void *arg) {
    reads_t *r = arg;
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED);
        if (i >= r->n || __atomic_load_n(&r->err, __ATOMIC_RELAXED) ||
            __atomic_load_n(&r->short_at, __ATOMIC_RELAXED) >= 0)
            return NULL;
        int64_t got = 0, len = r->ln[i];
        while (got < len) {
            ssize_t k = pread(r->fd, r->buf + r->bo[i] + got, (size_t)(len - got), (off_t)(r->fo[i] + got));
            if (k < 0 && errno == EINTR) continue;
            if (k < 0) {
                int e = errno, zero = 0;
                __atomic_compare_exchange_n(&r->err, &zero, e ? e : EIO, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
                return NULL;
            }
            if (k == 0) {
                int64_t at = r->fo[i] + got, cur = -1;
                while (!__atomic_compare_exchange_n(&r->short_at, &cur, at, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                    if (cur >= 0 && cur <= at) break;
                return NULL;
            }
            got += k;
        }
    }
}

#define MAX_READ_THREADS 64

static PyObject *py_pread_many(PyObject *self, PyObject *args) {
    int fd, threads;
    Py_buffer b[4] = {{0}}, *buf = &b[0], *tb = b + 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iw*y*y*y*i", &fd, buf, &tb[0], &tb[1], &tb[2], &threads)) return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = 0;
    int64_t *t = copy_tables(tb, 3, &n);
    if (!t) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (t[i] < 0 || t[n + i] < 0 || t[2 * n + i] < 0 || t[n + i] > buf->len - t[2 * n + i] ||
            t[i] > INT64_MAX - t[2 * n + i]) {
            PyErr_SetString(PyExc_ValueError, "range outside its buffer");
            goto done;
        }
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_READ_THREADS) threads = MAX_READ_THREADS;
    if (threads > n) threads = (int)(n ? n : 1);
    {
        reads_t r = {fd, buf->buf, t, t + n, t + 2 * n, n, 0, 0, -1};
        pthread_t th[MAX_READ_THREADS];
        int started = 0;
        Py_BEGIN_ALLOW_THREADS
        for (int k = 1; k < threads; k++)
            if (pthread_create(&th[started], NULL, read_worker, &r) == 0) started++;
        read_worker(&r); /* this thread reads too; ranges left by threads that failed to start are taken here */
        for (int k = 0; k < started; k++) pthread_join(th[k], NULL);
        Py_END_ALLOW_THREADS
        if (r.err) {
            errno = r.err;
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        if (r.short_at >= 0) {
            ret = PyLong_FromLongLong(r.short_at);
            goto done;
        }
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    return finish(ret, t, b, 4);
}

/* json_members(text, obj): (members in text, items in obj). text: UTF-8 JSON that json.loads
 * parsed into obj. Every ':' outside strings in valid JSON separates one object member from its
 * name, so the first count is the number of members written; the second sums len() of every
 * dict in obj (lists and dicts walked, exact types only, at most JSON_WALK_MAX deep). They are
 * equal exactly when no object repeats a member name (a repeated name keeps one item). -1 for
 * the second where obj is nested deeper than that (the caller then checks another way).
 * '"', '\\' and ':' never occur inside a multi-byte UTF-8 sequence, so bytes are scanned. */
#define JSON_WALK_MAX 512
static Py_ssize_t json_items(PyObject *o) {
    PyObject *stack[JSON_WALK_MAX];
    Py_ssize_t pos[JSON_WALK_MAX], total = 0;
    int top = 0;
    stack[0] = o;
    pos[0] = 0;
    if (PyDict_CheckExact(o)) total += PyDict_GET_SIZE(o);
    else if (!PyList_CheckExact(o)) return 0;
    while (top >= 0) {
        PyObject *c = stack[top], *child = NULL;
        if (PyDict_CheckExact(c)) {
            PyObject *k;
            if (!PyDict_Next(c, &pos[top], &k, &child)) child = NULL;
        } else if (pos[top] < PyList_GET_SIZE(c)) {
            child = PyList_GET_ITEM(c, pos[top]);
            pos[top]++;
        }
        if (child == NULL) {
            top--;
            continue;
        }
        if (PyDict_CheckExact(child) || PyList_CheckExact(child)) {
            if (top + 1 >= JSON_WALK_MAX) return -1;
            if (PyDict_CheckExact(child)) total += PyDict_GET_SIZE(child);
            stack[++top] = child;
            pos[top] = 0;
        }
    }
    return total;
}

static PyObject *py_json_members(PyObject *self, PyObject *args) {
    Py_buffer text = {0};
    PyObject *obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O", &text, &obj)) return NULL;
    const unsigned char *t = text.buf;
    Py_ssize_t n = text.len, colons = 0;
    int in_str = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = t[i];
        if (in_str) {
            if (c == '\\') i++;
            else if (c == '"') in_str = 0;
        } else if (c == '"') {
            in_str = 1;
        } else if (c == ':') {
            colons++;
        }
    }
    PyBuffer_Release(&text);
    return Py_BuildValue("(nn)", colons, json_items(obj));
}

static PyMethodDef methods[] = {
    {"exp_grid", py_exp_grid, METH_VARARGS, "exp_grid(src, out, r, c, w0, sign): expgrid's residual / inverse"},
    {"exp_fit", py_exp_fit, METH_VARARGS, "exp_fit(src, rm, cm, rows, cols, kc, kr): expgrid's CPU fit"},
    {"exp_ref", py_exp_ref, METH_VARARGS, "exp_ref(src, out, ref, sign): expref's residual / inverse"},
    {"plane_entropy", py_plane_entropy, METH_VARARGS,
     "plane_entropy(src, bits, width, starts, run): order-0 entropy of each byte plane of a sample"},
    {"top_entropy", py_top_entropy, METH_VARARGS,
     "top_entropy(src[, step]): order-0 entropy of the top byte plane of the rotated 4-byte words of src "
     "(of their expgrid / expref residual with a step)"},
    {"plane_entropy_many", py_plane_entropy_many, METH_VARARGS,
     "plane_entropy_many(srcs, widths, bits, run): plane_entropy of many buffers' 4 spread runs, in one call"},
    {"copy_segments", py_copy_segments, METH_VARARGS,
     "copy_segments(src, dst, soffs, doffs, lens): dst[doffs[i]:+lens[i]] = src[soffs[i]:+lens[i]]"},
    {"encode", py_encode, METH_VARARGS,
     "encode(src, out, width, block, w0, w1[, pre]): byte planes of words w0..w1, after an expgrid/expref pre step"},
    {"decode", py_decode, METH_VARARGS, "decode(src, dst, width, block, w0, w1): words w0..w1 from byte planes"},
    {"decode_onto", py_decode_onto, METH_VARARGS,
     "decode_onto(src, dst, ref, width, block, fold, w0, w1): decode, then xor (fold 1) or add the "
     "sign-folded difference (fold 2) onto ref"},
    {"zstd_decode", py_zstd_decode, METH_VARARGS,
     "zstd_decode(src, dst, soffs, ssizes, doffs, dsizes): zstd frames into their slots; None or (index, message)"},
    {"planes_fused", py_planes_fused, METH_VARARGS,
     "planes_fused(src, dst, width, planes, words0, words, soffs, ssizes, w0, w1[, xxh3]): words from their "
     "planes' stored and zstd chunks in one pass, verified first with xxh3; None or (index, message)"},
    {"planes_fused_many", py_planes_fused_many, METH_VARARGS,
     "planes_fused_many(src, items, order, counter): many planes_fused calls, shared between the threads "
     "that call it with the same order and counter; None or (item, chunk, message)"},
    {"xxh3_load", py_xxh3_load, METH_VARARGS,
     "xxh3_load(path): take XXH3_64bits_dispatch (else XXH3_64bits) from the loaded shared object path; whether it is loaded"},
    {"xxh3_many", py_xxh3_many, METH_VARARGS,
     "xxh3_many(buf, offs, sizes, out): XXH3-64 of every chunk into out (uint64)"},
    {"zstd_encode", py_zstd_encode, METH_VARARGS,
     "zstd_encode(src, dst, soffs, ssizes, doffs, dcaps, osizes, params): chunks into zstd frames"},
    {"fs_type", py_fs_type, METH_VARARGS, "fs_type(fd): the file system's magic number (0: unknown)"},
    {"fallocate", py_fallocate, METH_VARARGS, "fallocate(fd, mode, offset, length): Linux fallocate(2)"},
    {"cast_bf16", py_cast_bf16, METH_VARARGS,
     "cast_bf16(src, out[, other]): float32 words to bfloat16 (round to nearest even of the bits, NaN 0x7FC0), "
     "xor other's half-words"},
    {"cast_bf16_diff", py_cast_bf16_diff, METH_VARARGS,
     "cast_bf16_diff(src, tgt): how many bfloat16 words of tgt differ from cast_bf16 of src's float32 words"},
    {"huge_pages", py_huge_pages, METH_VARARGS,
     "huge_pages(buf): madvise(MADV_HUGEPAGE) on the whole 2 MiB pages inside buf; the bytes advised"},
    {"pread_many", py_pread_many, METH_VARARGS,
     "pread_many(fd, buf, foffs, boffs, lens, threads): file ranges into buf by POSIX threads; None or where the file ended"},
    {"json_members", py_json_members, METH_VARARGS,
     "json_members(text, obj): (object members written in the JSON text, items in the dicts json.loads made of it)"},
    {"zstd_version", py_zstd_version, METH_NOARGS, "libzstd's version number, or 0 where none was found"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bpnative",
                                    "ckptzip's CPU byteplane transform in C (see byteplane.py)", -1, methods,
                                    NULL, NULL, NULL, NULL};

/* what ckptzip.native checks: a build of another version of this file is not used */
#define BPNATIVE_API 18

PyMODINIT_FUNC PyInit__bpnative(void) {
    for (int c = 1; c < CLOG_N; c++) clog_tab[c] = (double)c * log2((double)c);
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "API", BPNATIVE_API) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
