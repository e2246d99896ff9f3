/* A CUDA program for the shim's tests. It reaches the driver one of three ways, as real
 * programs do (argv[1]): "link" (calls libcuda.so.1's symbols directly), "dlsym" (dlopen +
 * dlsym, like the CUDA runtime before 11.3), "procaddr" (only cuGetProcAddress_v2 is looked up,
 * everything else is fetched through it, like CUDA >= 11.3 runtimes). Then it runs a scenario
 * (argv[2]) and prints key=value lines. No CUDA headers: the prototypes are the driver's. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <signal.h>
#include <unistd.h>

typedef unsigned long long dptr_t;
typedef struct { size_t width, height; unsigned format, channels; } array_desc;
typedef struct { unsigned long long total, free, used; } nvml_memory;

int cuInit(unsigned);
int cuDeviceGet(int *, int);
int cuDevicePrimaryCtxRetain(void **, int);
int cuDevicePrimaryCtxRelease_v2(int);
int cuCtxSetCurrent(void *);
int cuMemGetInfo_v2(size_t *, size_t *);
int cuMemAlloc_v2(dptr_t *, size_t);
int cuMemFree_v2(dptr_t);
int cuMemAllocPitch_v2(dptr_t *, size_t *, size_t, size_t, unsigned);
int cuMemAllocManaged(dptr_t *, size_t, unsigned);
int cuMemAllocAsync(dptr_t *, size_t, void *);
int cuMemFreeAsync(dptr_t, void *);
int cuDeviceGetDefaultMemPool(void **, int);
int cuMemAllocFromPoolAsync(dptr_t *, size_t, void *, void *);
int cuMemCreate(unsigned long long *, size_t, const void *, unsigned long long);
int cuMemRelease(unsigned long long);
int cuArrayCreate_v2(void **, const array_desc *);
int cuArrayDestroy(void *);
int cuModuleLoadData(void **, const void *);
int cuModuleGetFunction(void **, void *, const char *);
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                   void *, void **, void **);
int cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
int nvmlInit_v2(void);
int nvmlDeviceGetHandleByIndex_v2(unsigned, void **);
int nvmlDeviceGetMemoryInfo(void *, nvml_memory *);

/* name as cuGetProcAddress knows it, exported symbol, field */
#define API(X)                                                            \
  X("cuInit", cuInit, init)                                               \
  X("cuDeviceGet", cuDeviceGet, device_get)                               \
  X("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain, retain)         \
  X("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2, release)   \
  X("cuCtxSetCurrent", cuCtxSetCurrent, set_current)                      \
  X("cuMemGetInfo", cuMemGetInfo_v2, get_info)                            \
  X("cuMemAlloc", cuMemAlloc_v2, alloc)                                   \
  X("cuMemFree", cuMemFree_v2, free)                                      \
  X("cuMemAllocPitch", cuMemAllocPitch_v2, alloc_pitch)                   \
  X("cuMemAllocManaged", cuMemAllocManaged, alloc_managed)                \
  X("cuMemAllocAsync", cuMemAllocAsync, alloc_async)                      \
  X("cuMemFreeAsync", cuMemFreeAsync, free_async)                         \
  X("cuDeviceGetDefaultMemPool", cuDeviceGetDefaultMemPool, default_pool) \
  X("cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync, alloc_from_pool)  \
  X("cuMemCreate", cuMemCreate, mem_create)                               \
  X("cuMemRelease", cuMemRelease, mem_release)                            \
  X("cuArrayCreate", cuArrayCreate_v2, array_create)                      \
  X("cuArrayDestroy", cuArrayDestroy, array_destroy)                      \
  X("cuModuleLoadData", cuModuleLoadData, module_load)                    \
  X("cuModuleGetFunction", cuModuleGetFunction, get_function)             \
  X("cuLaunchKernel", cuLaunchKernel, launch)

static struct {
#define FIELD(name, sym, field) __typeof__(&sym) field;
  API(FIELD)
  __typeof__(&nvmlInit_v2) nvml_init;
  __typeof__(&nvmlDeviceGetHandleByIndex_v2) nvml_handle;
  __typeof__(&nvmlDeviceGetMemoryInfo) nvml_memory;
} cu;

static void resolve(const char *mode) {
  if (strcmp(mode, "link") == 0) {
#define LINK(name, sym, field) cu.field = &sym;
    API(LINK)
    cu.nvml_init = &nvmlInit_v2;
    cu.nvml_handle = &nvmlDeviceGetHandleByIndex_v2;
    cu.nvml_memory = &nvmlDeviceGetMemoryInfo;
    return;
  }
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!lib || !nvml) { fprintf(stderr, "dlopen: %s\n", dlerror()); exit(3); }
  cu.nvml_init = dlsym(nvml, "nvmlInit_v2");
  cu.nvml_handle = dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2");
  cu.nvml_memory = dlsym(nvml, "nvmlDeviceGetMemoryInfo");
  if (strcmp(mode, "dlsym") == 0) {
#define DLSYM(name, sym, field) cu.field = dlsym(lib, #sym);
    API(DLSYM)
    return;
  }
  __typeof__(&cuGetProcAddress_v2) get = dlsym(lib, "cuGetProcAddress_v2");
  if (!get) { fprintf(stderr, "no cuGetProcAddress_v2\n"); exit(3); }
  int status;
#define PROC(name, sym, field) \
  if (get(name, (void **)&cu.field, 12080, 0, &status) != 0) { fprintf(stderr, "%s\n", name); exit(3); }
  API(PROC)
}

#define MiB (1ull << 20)

static void *context(void) {
  int dev;
  void *ctx;
  if (cu.init(0) || cu.device_get(&dev, 0) || cu.retain(&ctx, dev) || cu.set_current(ctx)) {
    fprintf(stderr, "no context\n");
    exit(4);
  }
  return ctx;
}

/* Fills the slice with 1 GiB allocations, then tries each kind of allocation just past what is
 * left and just under it. */
static int cap(void) {
  size_t free0, total;
  context();
  cu.get_info(&free0, &total);
  printf("info_free=%zu\ninfo_total=%zu\n", free0, total);
  dptr_t held[512];
  int n = 0, rc = 0;
  while (n < 512 && (rc = cu.alloc(&held[n], 1024 * MiB)) == 0) n++;
  printf("chunks=%d\nlast_rc=%d\n", n, rc);
  for (int i = 0; i < n; i++) cu.free(held[i]);

  size_t left, t;
  cu.get_info(&left, &t);
  printf("free_after=%zu\n", left);
  size_t over = left + 2 * MiB, fit = 64 * MiB;
  dptr_t p;
  size_t pitch;
  void *pool = 0, *array = 0;
  unsigned long long handle;
  int prop[8] = {1, 0, 1, 0, 0, 0, 0, 0};
  cu.default_pool(&pool, 0);
  array_desc big = {over / 16 + 1, 1, 0x20, 4}, small = {fit / 16, 1, 0x20, 4};
#define KIND(label, over_call, fit_call, release_call)           \
  printf(label "_over=%d\n", over_call);                          \
  rc = fit_call;                                                  \
  printf(label "_fit=%d\n", rc);                                  \
  if (rc == 0) release_call;
  KIND("alloc", cu.alloc(&p, over), cu.alloc(&p, fit), cu.free(p))
  KIND("pitch", cu.alloc_pitch(&p, &pitch, over / 1024 + 512, 1024, 4),
       cu.alloc_pitch(&p, &pitch, 4096, fit / 4096, 4), cu.free(p))
  KIND("managed", cu.alloc_managed(&p, over, 1), cu.alloc_managed(&p, fit, 1), cu.free(p))
  KIND("async", cu.alloc_async(&p, over, 0), cu.alloc_async(&p, fit, 0), cu.free_async(p, 0))
  KIND("pool", cu.alloc_from_pool(&p, over, pool, 0), cu.alloc_from_pool(&p, fit, pool, 0),
       cu.free_async(p, 0))
  KIND("vmm", cu.mem_create(&handle, (over / (2 * MiB) + 1) * 2 * MiB, prop, 0),
       cu.mem_create(&handle, fit, prop, 0), cu.mem_release(handle))
  KIND("array", cu.array_create(&array, &big), cu.array_create(&array, &small),
       cu.array_destroy(array))
  cu.get_info(&left, &t);
  printf("free_end=%zu\n", left);

  void *device;
  nvml_memory m;
  if (cu.nvml_init() == 0 && cu.nvml_handle(0, &device) == 0 && cu.nvml_memory(device, &m) == 0)
    printf("nvml_total=%llu\nnvml_used=%llu\n", m.total, m.used);
  return 0;
}

/* One of many processes of a workload: allocate and free at random, never holding more than
 * argv[4] MiB; count allocations that failed. */
static int churn(int rounds, unsigned seed, unsigned max_mib) {
  context();
  dptr_t held[64];
  size_t sizes[64];
  int n = 0, failures = 0;
  size_t total = 0;
  for (int r = 0; r < rounds; r++) {
    size_t want = (1 + rand_r(&seed) % 16) * MiB;
    if (n < 64 && total + want <= max_mib * MiB && rand_r(&seed) % 3) {
      if (cu.alloc(&held[n], want) == 0) { sizes[n++] = want; total += want; }
      else failures++;
    } else if (n > 0) {
      int i = rand_r(&seed) % n;
      cu.free(held[i]);
      total -= sizes[i];
      held[i] = held[--n];
      sizes[i] = sizes[n];
    }
    if (r % 16 == 0) usleep(1000);
  }
  while (n > 0) cu.free(held[--n]);
  cu.release(0);
  printf("failures=%d\n", failures);
  return failures != 0;
}

#include <time.h>

/* Takes argv[3] MiB more every 200 ms until it holds argv[4] MiB (refusals are tried again),
 * saying how much it holds after each allocation; then holds it until killed. */
static int creep(long step_mib, long total_mib) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  context();
  size_t got = 0;
  while (got < (size_t)total_mib * MiB) {
    dptr_t p;
    if (cu.alloc(&p, (size_t)step_mib * MiB) == 0) {
      got += (size_t)step_mib * MiB;
      printf("held=%zu\n", got);
    }
    usleep(200000);
  }
  for (;;) sleep(60);
}

/* Takes argv[3] MiB in allocations of at most 1 GiB, says how much it got, and holds it until
 * killed (a workload that keeps its memory). */
static int hold(long mib) {
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* a test that kills its parent leaves nothing behind */
  context();
  size_t left = (size_t)mib * MiB, got = 0;
  while (left > 0) {
    size_t want = left < 1024 * MiB ? left : 1024 * MiB;
    dptr_t p;
    if (cu.alloc(&p, want) != 0) break;
    got += want;
    left -= want;
  }
  printf("held=%zu\n", got);
  for (;;) sleep(60);
}

static void *kernel;

/* Runs one operation n times: "launch", "alloc" (cuMemAlloc + cuMemFree of 4 KiB), "info". */
static void run_op(const char *op, long n) {
  dptr_t p;
  size_t f, t;
  if (strcmp(op, "launch") == 0)
    for (long i = 0; i < n; i++) cu.launch(kernel, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
  else if (strcmp(op, "alloc") == 0)
    for (long i = 0; i < n; i++) { cu.alloc(&p, 4096); cu.free(p); }
  else if (strcmp(op, "info") == 0)
    for (long i = 0; i < n; i++) cu.get_info(&f, &t);
}

static void setup_kernel(void) {
  void *module;
  context();
  if (cu.module_load(&module, "gpuslice-emulator") || cu.get_function(&kernel, module, "noop")) exit(5);
}

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Launches kernels until killed, saying every 100 ms how many went through. */
static int spin(void) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  setup_kernel();
  long n = 0;
  double last = now_ns();
  for (;;) {
    cu.launch(kernel, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
    n++;
    if (now_ns() - last > 1e8) {
      printf("launched=%ld\n", n);
      last = now_ns();
    }
  }
}

/* Median ns per call over 9 batches of n calls, for each operation. */
static int bench(long n) {
  const char *ops[] = {"launch", "alloc", "info"};
  setup_kernel();
  for (int o = 0; o < 3; o++) {
    double batch[9];
    run_op(ops[o], n / 10);
    for (int b = 0; b < 9; b++) {
      double start = now_ns();
      run_op(ops[o], n);
      batch[b] = (now_ns() - start) / n;
    }
    qsort(batch, 9, sizeof batch[0], cmp);
    printf("%s_ns=%.1f\n", ops[o], batch[4]);
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: probe link|dlsym|procaddr cap|bench|count|churn|hold|spin|creep ...\n"); return 2; }
  resolve(argv[1]);
  setvbuf(stdout, 0, _IONBF, 0);
  if (strcmp(argv[2], "cap") == 0) return cap();
  if (strcmp(argv[2], "bench") == 0 && argc == 4) return bench(atol(argv[3]));
  if (strcmp(argv[2], "hold") == 0 && argc == 4) return hold(atol(argv[3]));
  if (strcmp(argv[2], "spin") == 0) return spin();
  if (strcmp(argv[2], "creep") == 0 && argc == 5) return creep(atol(argv[3]), atol(argv[4]));
  if (strcmp(argv[2], "count") == 0 && argc == 5) {
    setup_kernel();
    run_op(argv[3], atol(argv[4]));
    return 0;
  }
  if (strcmp(argv[2], "churn") == 0 && argc == 6)
    return churn(atoi(argv[3]), (unsigned)atoi(argv[4]), (unsigned)atoi(argv[5]));
  return 2;
}
