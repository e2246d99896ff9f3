// Command gonvml drives MIG through NVIDIA's own Go bindings (github.com/NVIDIA/go-nvml) the way
// NVIDIA's mig-parted does, so that an NVML implementation (the gpuslice emulator, or a real
// driver) is judged by NVIDIA's client code rather than by ours.
//
//	gonvml profiles                 GPU-instance profiles of every GPU (read-only)
//	gonvml export                   the MIG layout, named as mig-parted names it (read-only)
//	gonvml apply FILE.json [--force] mig-parted's apply: clear, then create in its order
//	gonvml conformance              NVIDIA's documented MIG behaviour, checked on GPU 0
//
// NVML comes from $GONVML_LIBRARY when set, else libnvidia-ml.so.1. Every subcommand prints JSON
// on stdout; a failing NVML call is reported on stderr with the call and NVML's error string, and
// the exit status is nonzero.
//
// Facts taken from mig-parted (pkg/mig/config, internal/nvlib/mig) and go-nvlib
// (pkg/nvlib/device/mig_profile.go), which this file re-implements rather than imports:
//   - GPU instances are enumerated per profile index 0..GPU_INSTANCE_PROFILE_COUNT-1
//     (NOT_SUPPORTED and INVALID_ARGUMENT skipped) with GetGpuInstances(&info), which go-nvml
//     calls with a buffer of info.InstanceCount; compute instances likewise per (profile index,
//     engine profile) with GetComputeInstances(&ciInfo).
//   - A profile's name is derived from the profile *indices* (slice counts from tables, "+me",
//     "-me", "+me.all", "+gfx" attributes from the GI index) and the GB figure rounded from
//     info.MemorySizeMB against the parent's GetMemoryInfo().Total: "Ng.XXgb" when the compute
//     profile spans the whole GI, else "Mc.Ng.XXgb".
//   - apply flattens the requested counts largest first (G, then C, descending), tries that
//     order and then every other distinct permutation until one succeeds, clearing the GPU before
//     each attempt; GPU instances are created with CreateGpuInstance (no placement, so the driver
//     picks it) and each gets the requested compute instance; a GI of the same profile as the
//     previous one is reused first, and only when its CreateComputeInstance fails is a new GI
//     created.
package main

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef RTLD_DEFAULT
#define RTLD_DEFAULT ((void *)0)
#endif

// The raw calls below exist only for the conformance rows go-nvml cannot express (an input
// count of 0, a NULL placements buffer). They resolve symbols in the library go-nvml loaded
// (it uses RTLD_GLOBAL), so they talk to the same NVML state.
typedef struct { unsigned int start; unsigned int size; } gonvml_placement;

// Handles cross into Go as integers, never as Go pointers: a C handle is opaque, and Go's runtime
// rejects pointer-typed values below 4096 (see the "handle values" conformance rows).
static void *gonvml_sym(const char *name) { return dlsym(RTLD_DEFAULT, name); }

static int gonvml_handle_by_index(void *fn, unsigned int index, uintptr_t *out) {
	void *h = NULL;
	int ret = ((int (*)(unsigned int, void **))fn)(index, &h);
	*out = (uintptr_t)h;
	return ret;
}

static int gonvml_by_id(void *fn, uintptr_t parent, unsigned int id, uintptr_t *out) {
	void *h = NULL;
	int ret = ((int (*)(void *, unsigned int, void **))fn)((void *)parent, id, &h);
	*out = (uintptr_t)h;
	return ret;
}

static int gonvml_list(void *fn, uintptr_t parent, unsigned int profileId, void **buf, unsigned int *count) {
	return ((int (*)(void *, unsigned int, void **, unsigned int *))fn)((void *)parent, profileId, buf, count);
}

static int gonvml_placements(void *fn, uintptr_t device, unsigned int profileId, gonvml_placement *buf,
                             unsigned int *count) {
	return ((int (*)(void *, unsigned int, gonvml_placement *, unsigned int *))fn)((void *)device, profileId, buf, count);
}
*/
import "C"

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

const mib = 1 << 20

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var (
		out any
		err error
	)
	lib, err := open(os.Args[1])
	if err != nil {
		fatal(os.Args[1], err)
	}
	defer lib.Shutdown()
	failed := false
	switch os.Args[1] {
	case "profiles":
		out, err = profiles(lib)
	case "export":
		out, err = export(lib)
	case "apply":
		if len(os.Args) < 3 || len(os.Args) > 4 || (len(os.Args) == 4 && os.Args[3] != "--force") {
			usage()
		}
		out, err = apply(lib, os.Args[2], len(os.Args) == 4)
	case "conformance":
		var rows []row
		rows, err = conformance(lib)
		out = rows
		for _, r := range rows {
			failed = failed || !r.OK
		}
	default:
		usage()
	}
	if out != nil {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		if e := enc.Encode(out); e != nil && err == nil {
			err = e
		}
	}
	if err != nil {
		lib.Shutdown()
		fatal(os.Args[1], err)
	}
	if failed {
		lib.Shutdown()
		fmt.Fprintln(os.Stderr, "gonvml conformance: some rows failed (ok: false)")
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: gonvml profiles | export | apply FILE.json [--force] | conformance\n"+
		"  (NVML from $GONVML_LIBRARY, else libnvidia-ml.so.1)")
	os.Exit(2)
}

func fatal(cmd string, err error) {
	fmt.Fprintf(os.Stderr, "gonvml %s: %v\n", cmd, err)
	os.Exit(1)
}

// ---------------------------------------------------------------------------------------------
// NVML errors and symbols

var returnNames = map[nvml.Return]string{
	nvml.SUCCESS:                         "SUCCESS",
	nvml.ERROR_UNINITIALIZED:             "ERROR_UNINITIALIZED",
	nvml.ERROR_INVALID_ARGUMENT:          "ERROR_INVALID_ARGUMENT",
	nvml.ERROR_NOT_SUPPORTED:             "ERROR_NOT_SUPPORTED",
	nvml.ERROR_NO_PERMISSION:             "ERROR_NO_PERMISSION",
	nvml.ERROR_ALREADY_INITIALIZED:       "ERROR_ALREADY_INITIALIZED",
	nvml.ERROR_NOT_FOUND:                 "ERROR_NOT_FOUND",
	nvml.ERROR_INSUFFICIENT_SIZE:         "ERROR_INSUFFICIENT_SIZE",
	nvml.ERROR_DRIVER_NOT_LOADED:         "ERROR_DRIVER_NOT_LOADED",
	nvml.ERROR_LIBRARY_NOT_FOUND:         "ERROR_LIBRARY_NOT_FOUND",
	nvml.ERROR_FUNCTION_NOT_FOUND:        "ERROR_FUNCTION_NOT_FOUND",
	nvml.ERROR_GPU_IS_LOST:               "ERROR_GPU_IS_LOST",
	nvml.ERROR_RESET_REQUIRED:            "ERROR_RESET_REQUIRED",
	nvml.ERROR_IN_USE:                    "ERROR_IN_USE",
	nvml.ERROR_MEMORY:                    "ERROR_MEMORY",
	nvml.ERROR_NO_DATA:                   "ERROR_NO_DATA",
	nvml.ERROR_INSUFFICIENT_RESOURCES:    "ERROR_INSUFFICIENT_RESOURCES",
	nvml.ERROR_ARGUMENT_VERSION_MISMATCH: "ERROR_ARGUMENT_VERSION_MISMATCH",
	nvml.ERROR_NOT_READY:                 "ERROR_NOT_READY",
	nvml.ERROR_UNKNOWN:                   "ERROR_UNKNOWN",
}

// retName is the nvml.h name without the NVML_ prefix, e.g. ERROR_IN_USE.
func retName(r nvml.Return) string {
	if n, ok := returnNames[r]; ok {
		return n
	}
	return fmt.Sprintf("RETURN_%d", int32(r))
}

// describe gives the name, the code and NVML's own error string (nvmlErrorString).
func describe(r nvml.Return) string {
	if r == nvml.SUCCESS {
		return "SUCCESS"
	}
	return fmt.Sprintf("%s (%d: %s)", retName(r), int32(r), r.Error())
}

type callError struct {
	call string
	ret  nvml.Return
}

func (e *callError) Error() string { return e.call + ": " + describe(e.ret) }

func fail(call string, ret nvml.Return) error { return &callError{call, ret} }

func isSkip(ret nvml.Return) bool {
	return ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT
}

// The C symbols go-nvml calls for each subcommand ("a|b": go-nvml takes a when exported, else b).
// go-nvml binds them lazily, so a missing one would abort the process in the middle of a
// command; they are checked up front instead.
var (
	symbolsCommon = []string{
		"nvmlShutdown", "nvmlErrorString", "nvmlDeviceGetCount_v2|nvmlDeviceGetCount",
		"nvmlDeviceGetHandleByIndex_v2|nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID",
		"nvmlDeviceGetMigMode", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetGpuInstanceProfileInfo",
	}
	symbolsProfiles = []string{
		"nvmlDeviceGetName", "nvmlDeviceGetMinorNumber",
		"nvmlDeviceGetGpuInstancePossiblePlacements_v2|nvmlDeviceGetGpuInstancePossiblePlacements",
		"nvmlDeviceGetGpuInstanceRemainingCapacity",
	}
	symbolsExport = []string{
		"nvmlDeviceGetGpuInstances", "nvmlGpuInstanceGetInfo",
		"nvmlGpuInstanceGetComputeInstanceProfileInfo", "nvmlGpuInstanceGetComputeInstances",
		"nvmlComputeInstanceGetInfo_v2|nvmlComputeInstanceGetInfo", "nvmlDeviceGetMaxMigDeviceCount",
		"nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetGpuInstanceId",
		"nvmlDeviceGetComputeInstanceId",
	}
	symbolsApply = []string{
		"nvmlDeviceSetMigMode", "nvmlDeviceCreateGpuInstance", "nvmlGpuInstanceCreateComputeInstance",
		"nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy",
	}
	symbolsConformance = []string{
		"nvmlDeviceGetGpuInstanceProfileInfoV", "nvmlDeviceGetGpuInstanceById",
		"nvmlGpuInstanceGetComputeInstanceById", "nvmlDeviceIsMigDeviceHandle",
		"nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
	}
)

func open(cmd string) (nvml.Interface, error) {
	var lib nvml.Interface
	path := os.Getenv("GONVML_LIBRARY")
	if path != "" {
		lib = nvml.New(nvml.WithLibraryPath(path))
	} else {
		path = "libnvidia-ml.so.1"
		lib = nvml.New()
	}
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("%s: %w", path, fail("nvmlInit", ret))
	}
	need := append([]string{}, symbolsCommon...)
	switch cmd {
	case "profiles":
		need = append(need, symbolsProfiles...)
	case "export":
		need = append(need, symbolsExport...)
	case "apply":
		need = append(append(need, symbolsExport...), symbolsApply...)
	case "conformance":
		need = append(append(append(append(need, symbolsProfiles...), symbolsExport...), symbolsApply...),
			symbolsConformance...)
	}
	var missing []string
	for _, alternatives := range need {
		found := false
		for _, name := range strings.Split(alternatives, "|") {
			if lib.Extensions().LookupSymbol(name) == nil {
				found = true
				break
			}
		}
		if !found {
			missing = append(missing, alternatives)
		}
	}
	if len(missing) > 0 {
		lib.Shutdown()
		return nil, fmt.Errorf("%s does not export %s", path, strings.Join(missing, ", "))
	}
	return lib, nil
}

func hasSymbol(lib nvml.Interface, name string) bool {
	return lib.Extensions().LookupSymbol(name) == nil
}

func cString(b []int8) string {
	var s []byte
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}

// ---------------------------------------------------------------------------------------------
// MIG profile names, as go-nvlib's NewMigProfile / MigProfileInfo.String derive them

type migProfile struct {
	C, G, GB   int
	Attrs, Neg []string
	GIIndex    int // NVML_GPU_INSTANCE_PROFILE_* (the index, not info.Id)
	CIIndex    int // NVML_COMPUTE_INSTANCE_PROFILE_*
	EngIndex   int // NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_*
}

func giSlices(index int) (slices int, attrs, neg []string, ok bool) {
	switch index {
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE:
		return 1, nil, nil, true
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1:
		return 1, []string{"me"}, nil, true
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2:
		return 1, nil, nil, true
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_GFX:
		return 1, []string{"gfx"}, nil, true
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_NO_ME:
		return 1, nil, []string{"me"}, true
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME:
		return 1, []string{"me.all"}, nil, true
	case nvml.GPU_INSTANCE_PROFILE_2_SLICE:
		return 2, nil, nil, true
	case nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1:
		return 2, []string{"me"}, nil, true
	case nvml.GPU_INSTANCE_PROFILE_2_SLICE_GFX:
		return 2, []string{"gfx"}, nil, true
	case nvml.GPU_INSTANCE_PROFILE_2_SLICE_NO_ME:
		return 2, nil, []string{"me"}, true
	case nvml.GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME:
		return 2, []string{"me.all"}, nil, true
	case nvml.GPU_INSTANCE_PROFILE_3_SLICE:
		return 3, nil, nil, true
	case nvml.GPU_INSTANCE_PROFILE_3_SLICE_GFX:
		// Not in go-nvlib v0.12.0 (mig-parted would refuse it); named by the same rule as 1/2/4 GFX.
		return 3, []string{"gfx"}, nil, true
	case nvml.GPU_INSTANCE_PROFILE_4_SLICE:
		return 4, nil, nil, true
	case nvml.GPU_INSTANCE_PROFILE_4_SLICE_GFX:
		return 4, []string{"gfx"}, nil, true
	case nvml.GPU_INSTANCE_PROFILE_6_SLICE:
		return 6, nil, nil, true
	case nvml.GPU_INSTANCE_PROFILE_7_SLICE:
		return 7, nil, nil, true
	case nvml.GPU_INSTANCE_PROFILE_8_SLICE:
		return 8, nil, nil, true
	}
	return 0, nil, nil, false
}

func ciSlices(index int) (int, bool) {
	switch index {
	case nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1:
		return 1, true
	case nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE:
		return 2, true
	case nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE:
		return 3, true
	case nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE:
		return 4, true
	case nvml.COMPUTE_INSTANCE_PROFILE_6_SLICE:
		return 6, true
	case nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE, nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL:
		return 7, true
	case nvml.COMPUTE_INSTANCE_PROFILE_8_SLICE:
		return 8, true
	}
	return 0, false
}

// fullComputeIndex is the first compute-profile index spanning g slices: the one a name without
// a "Mc." prefix resolves to.
func fullComputeIndex(g int) (int, bool) {
	for j := 0; j < nvml.COMPUTE_INSTANCE_PROFILE_COUNT; j++ {
		if c, ok := ciSlices(j); ok && c == g {
			return j, true
		}
	}
	return 0, false
}

// migMemoryGB: the fraction of the device's memory, rounded up to eighths, times the device's
// memory in whole GiB (rounded up), rounded to the nearest integer.
func migMemoryGB(deviceTotalBytes, migMemoryMB uint64) int {
	const eighths = 8
	fraction := float64(migMemoryMB) * mib / float64(deviceTotalBytes)
	fraction = math.Ceil(fraction*eighths) / eighths
	totalGB := float64((deviceTotalBytes + (1 << 30) - 1) / (1 << 30))
	return int(math.Round(fraction * totalGB))
}

func newMigProfile(giIndex, ciIndex, engIndex int, migMemoryMB, deviceTotalBytes uint64) (*migProfile, error) {
	g, attrs, neg, ok := giSlices(giIndex)
	if !ok {
		return nil, fmt.Errorf("invalid GPU instance profile index %d", giIndex)
	}
	c, ok := ciSlices(ciIndex)
	if !ok {
		return nil, fmt.Errorf("invalid compute instance profile index %d", ciIndex)
	}
	return &migProfile{
		C: c, G: g, GB: migMemoryGB(deviceTotalBytes, migMemoryMB), Attrs: attrs, Neg: neg,
		GIIndex: giIndex, CIIndex: ciIndex, EngIndex: engIndex,
	}, nil
}

func (p *migProfile) String() string {
	suffix := ""
	if len(p.Attrs) > 0 {
		suffix = "+" + strings.Join(p.Attrs, ",")
	}
	if len(p.Neg) > 0 {
		suffix = "-" + strings.Join(p.Neg, ",")
	}
	if p.C == p.G {
		return fmt.Sprintf("%dg.%dgb%s", p.G, p.GB, suffix)
	}
	return fmt.Sprintf("%dc.%dg.%dgb%s", p.C, p.G, p.GB, suffix)
}

func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	x := append([]string{}, a...)
	y := append([]string{}, b...)
	sort.Strings(x)
	sort.Strings(y)
	for i := range x {
		if x[i] != y[i] {
			return false
		}
	}
	return true
}

// matches compares what a name says (C, G, GB, attributes), as MigProfileInfo.Matches does.
func (p *migProfile) matches(q *migProfile) bool {
	return p.C == q.C && p.G == q.G && p.GB == q.GB && sameSet(p.Attrs, q.Attrs) && sameSet(p.Neg, q.Neg)
}

func (p *migProfile) equals(q *migProfile) bool {
	return p.C == q.C && p.G == q.G && p.GB == q.GB && p.GIIndex == q.GIIndex &&
		p.CIIndex == q.CIIndex && p.EngIndex == q.EngIndex
}

// parseMigProfile reads "Ng.Xgb", "Mc.Ng.Xgb", with "+attr,attr" or "-attr" (format only).
func parseMigProfile(s string) (*migProfile, error) {
	if s == "" {
		return nil, errors.New("empty profile name")
	}
	plus := strings.SplitN(s, "+", 2)
	minus := strings.SplitN(s, "-", 2)
	if len(plus) == 2 && len(minus) == 2 {
		return nil, fmt.Errorf("profile %q has both '+' and '-' attributes", s)
	}
	parts, negative := plus, false
	if len(plus) == 1 {
		parts, negative = minus, len(minus) == 2
	}
	field := func(f, unit string) (int, error) {
		if !strings.HasSuffix(f, unit) {
			return 0, fmt.Errorf("profile %q: %q lacks %q", s, f, unit)
		}
		n, err := strconv.Atoi(strings.TrimSuffix(f, unit))
		if err != nil || n < 0 || strings.TrimSpace(f) != f {
			return 0, fmt.Errorf("profile %q: malformed %q", s, f)
		}
		return n, nil
	}
	p := &migProfile{}
	var err error
	fields := strings.Split(parts[0], ".")
	withC := len(fields) == 3
	switch {
	case withC:
		if p.C, err = field(fields[0], "c"); err != nil {
			return nil, err
		}
		fields = fields[1:]
	case len(fields) != 2:
		return nil, fmt.Errorf("profile %q: expected Ng.Xgb or Mc.Ng.Xgb", s)
	}
	if p.G, err = field(fields[0], "g"); err != nil {
		return nil, err
	}
	if p.GB, err = field(fields[1], "gb"); err != nil {
		return nil, err
	}
	if !withC {
		p.C = p.G
	}
	if len(parts) == 2 {
		attrs := strings.Split(parts[1], ",")
		seen := map[string]bool{}
		for _, a := range attrs {
			if a == "" || seen[a] || a[0] == '.' || a[len(a)-1] == '.' || (a[0] >= '0' && a[0] <= '9') {
				return nil, fmt.Errorf("profile %q: malformed attribute %q", s, a)
			}
			seen[a] = true
		}
		if negative {
			p.Neg = attrs
		} else {
			p.Attrs = attrs
		}
	}
	return p, nil
}

// deviceProfiles lists the profiles a GPU offers, in go-nvlib's VisitMigProfiles order (GI index,
// CI index, engine profile), with its heuristic that drops impossible C/G combinations.
func deviceProfiles(dev nvml.Device, totalBytes uint64) ([]*migProfile, error) {
	var out []*migProfile
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, ret := dev.GetGpuInstanceProfileInfo(i)
		if isSkip(ret) {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, fail(fmt.Sprintf("GetGpuInstanceProfileInfo(%d)", i), ret)
		}
		for j := 0; j < nvml.COMPUTE_INSTANCE_PROFILE_COUNT; j++ {
			for k := 0; k < nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT; k++ {
				p, err := newMigProfile(i, j, k, info.MemorySizeMB, totalBytes)
				if err != nil {
					return nil, err
				}
				if p.C > p.G || (p.C < p.G && p.C*2 > p.G+1) {
					continue
				}
				out = append(out, p)
			}
		}
	}
	return out, nil
}

// ---------------------------------------------------------------------------------------------
// Walking GPU and compute instances, as mig-parted's internal/nvlib/mig does

func walkGpuInstances(dev nvml.Device, f func(gi nvml.GpuInstance, index int, info nvml.GpuInstanceProfileInfo) error) error {
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, ret := dev.GetGpuInstanceProfileInfo(i)
		if isSkip(ret) {
			continue
		}
		if ret != nvml.SUCCESS {
			return fail(fmt.Sprintf("GetGpuInstanceProfileInfo(%d)", i), ret)
		}
		gis, ret := dev.GetGpuInstances(&info)
		if ret != nvml.SUCCESS {
			return fail(fmt.Sprintf("GetGpuInstances(profileId=%d, buffer of instanceCount=%d)", info.Id, info.InstanceCount), ret)
		}
		for _, gi := range gis {
			if err := f(gi, i, info); err != nil {
				return err
			}
		}
	}
	return nil
}

func walkComputeInstances(gi nvml.GpuInstance, f func(ci nvml.ComputeInstance, j, k int, info nvml.ComputeInstanceProfileInfo) error) error {
	for j := 0; j < nvml.COMPUTE_INSTANCE_PROFILE_COUNT; j++ {
		for k := 0; k < nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT; k++ {
			info, ret := gi.GetComputeInstanceProfileInfo(j, k)
			if isSkip(ret) {
				continue
			}
			if ret != nvml.SUCCESS {
				return fail(fmt.Sprintf("GpuInstance.GetComputeInstanceProfileInfo(%d, %d)", j, k), ret)
			}
			cis, ret := gi.GetComputeInstances(&info)
			if ret != nvml.SUCCESS {
				return fail(fmt.Sprintf("GpuInstance.GetComputeInstances(profileId=%d, buffer of instanceCount=%d)", info.Id, info.InstanceCount), ret)
			}
			for _, ci := range cis {
				if err := f(ci, j, k, info); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func deviceByIndex(lib nvml.Interface, i int) (nvml.Device, error) {
	dev, ret := lib.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		return nil, fail(fmt.Sprintf("DeviceGetHandleByIndex(%d)", i), ret)
	}
	return dev, nil
}

func memoryTotal(dev nvml.Device, what string) (uint64, error) {
	mem, ret := dev.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return 0, fail(what+".GetMemoryInfo", ret)
	}
	return mem.Total, nil
}

// migMode: capable is false where GetMigMode answers NOT_SUPPORTED (mig-parted's IsMigCapable).
func migMode(dev nvml.Device, i int) (capable bool, current, pending int, err error) {
	current, pending, ret := dev.GetMigMode()
	if ret == nvml.ERROR_NOT_SUPPORTED {
		return false, 0, 0, nil
	}
	if ret != nvml.SUCCESS {
		return false, 0, 0, fail(fmt.Sprintf("GPU %d GetMigMode", i), ret)
	}
	return true, current, pending, nil
}

// ---------------------------------------------------------------------------------------------
// profiles

type placementJSON struct {
	Start uint32 `json:"start"`
	Size  uint32 `json:"size"`
}

type modeJSON struct {
	Current int `json:"current"`
	Pending int `json:"pending"`
}

type profileJSON struct {
	Index               int             `json:"index"`
	ID                  uint32          `json:"id"`
	Name                *string         `json:"name"` // GpuInstanceProfileInfo_v2.name; null when the V call fails
	MigPartedName       string          `json:"migPartedName"`
	SliceCount          uint32          `json:"sliceCount"`
	InstanceCount       uint32          `json:"instanceCount"`
	MemorySizeMB        uint64          `json:"memorySizeMB"`
	MultiprocessorCount uint32          `json:"multiprocessorCount"`
	Placements          []placementJSON `json:"placements"`
	RemainingCapacity   *int            `json:"remainingCapacity"` // null when NOT_SUPPORTED (MIG disabled)
}

type gpuProfilesJSON struct {
	Index            int           `json:"index"`
	Name             string        `json:"name"`
	UUID             string        `json:"uuid"`
	MinorNumber      int           `json:"minorNumber"`
	MemoryTotalBytes uint64        `json:"memoryTotalBytes"`
	MigCapable       bool          `json:"migCapable"`
	MigMode          *modeJSON     `json:"migMode"`
	Profiles         []profileJSON `json:"profiles"`
}

func profiles(lib nvml.Interface) (any, error) {
	count, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fail("DeviceGetCount", ret)
	}
	withV2 := hasSymbol(lib, "nvmlDeviceGetGpuInstanceProfileInfoV")
	gpus := []gpuProfilesJSON{}
	for i := 0; i < count; i++ {
		dev, err := deviceByIndex(lib, i)
		if err != nil {
			return nil, err
		}
		g := gpuProfilesJSON{Index: i, Profiles: []profileJSON{}}
		if g.Name, ret = dev.GetName(); ret != nvml.SUCCESS {
			return nil, fail(fmt.Sprintf("GPU %d GetName", i), ret)
		}
		if g.UUID, ret = dev.GetUUID(); ret != nvml.SUCCESS {
			return nil, fail(fmt.Sprintf("GPU %d GetUUID", i), ret)
		}
		if g.MinorNumber, ret = dev.GetMinorNumber(); ret != nvml.SUCCESS {
			return nil, fail(fmt.Sprintf("GPU %d GetMinorNumber", i), ret)
		}
		if g.MemoryTotalBytes, err = memoryTotal(dev, fmt.Sprintf("GPU %d", i)); err != nil {
			return nil, err
		}
		capable, current, pending, err := migMode(dev, i)
		if err != nil {
			return nil, err
		}
		g.MigCapable = capable
		if capable {
			g.MigMode = &modeJSON{current, pending}
		}
		for p := 0; capable && p < nvml.GPU_INSTANCE_PROFILE_COUNT; p++ {
			info, ret := dev.GetGpuInstanceProfileInfo(p)
			if isSkip(ret) {
				continue
			}
			if ret != nvml.SUCCESS {
				return nil, fail(fmt.Sprintf("GPU %d GetGpuInstanceProfileInfo(%d)", i, p), ret)
			}
			pj := profileJSON{
				Index: p, ID: info.Id, SliceCount: info.SliceCount, InstanceCount: info.InstanceCount,
				MemorySizeMB: info.MemorySizeMB, MultiprocessorCount: info.MultiprocessorCount,
				Placements: []placementJSON{},
			}
			if withV2 {
				if v2, ret := dev.GetGpuInstanceProfileInfoV(p).V2(); ret == nvml.SUCCESS {
					name := cString(v2.Name[:])
					pj.Name = &name
				}
			}
			if full, ok := fullComputeIndex(int(info.SliceCount)); ok {
				if mp, err := newMigProfile(p, full, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, info.MemorySizeMB, g.MemoryTotalBytes); err == nil {
					pj.MigPartedName = mp.String()
				}
			}
			placements, ret := dev.GetGpuInstancePossiblePlacements(&info)
			if ret != nvml.SUCCESS {
				return nil, fail(fmt.Sprintf("GPU %d GetGpuInstancePossiblePlacements(profileId=%d)", i, info.Id), ret)
			}
			for _, pl := range placements {
				pj.Placements = append(pj.Placements, placementJSON{pl.Start, pl.Size})
			}
			remaining, ret := dev.GetGpuInstanceRemainingCapacity(&info)
			switch ret {
			case nvml.SUCCESS:
				pj.RemainingCapacity = &remaining
			case nvml.ERROR_NOT_SUPPORTED:
			default:
				return nil, fail(fmt.Sprintf("GPU %d GetGpuInstanceRemainingCapacity(profileId=%d)", i, info.Id), ret)
			}
			g.Profiles = append(g.Profiles, pj)
		}
		gpus = append(gpus, g)
	}
	return map[string]any{"gpus": gpus}, nil
}

// ---------------------------------------------------------------------------------------------
// export

type migDeviceJSON struct {
	Index             int    `json:"index"` // GetMigDeviceHandleByIndex index
	UUID              string `json:"uuid"`
	GpuInstanceID     int    `json:"gpuInstanceId"`
	ComputeInstanceID int    `json:"computeInstanceId"`
	MemoryTotalBytes  uint64 `json:"memoryTotalBytes"`
}

type ciJSON struct {
	ID            uint32         `json:"id"`
	ProfileIndex  int            `json:"profileIndex"`
	EngineProfile int            `json:"engineProfile"`
	ProfileID     uint32         `json:"profileId"`
	Placement     placementJSON  `json:"placement"`
	Name          string         `json:"name"` // the mig-parted name this compute instance counts under
	MigDevice     *migDeviceJSON `json:"migDevice"`
}

type giJSON struct {
	ID               uint32        `json:"id"`
	ProfileIndex     int           `json:"profileIndex"`
	ProfileID        uint32        `json:"profileId"`
	Placement        placementJSON `json:"placement"`
	ComputeInstances []ciJSON      `json:"computeInstances"`
}

type gpuExportJSON struct {
	Index               int             `json:"index"`
	UUID                string          `json:"uuid"`
	MigCapable          bool            `json:"migCapable"`
	MigEnabled          bool            `json:"migEnabled"`
	MigDevices          map[string]int  `json:"migDevices"`
	GpuInstances        []giJSON        `json:"gpuInstances"`
	UnmatchedMigDevices []migDeviceJSON `json:"unmatchedMigDevices,omitempty"`
}

type exportJSON struct {
	GPUs []gpuExportJSON `json:"gpus"`
}

func export(lib nvml.Interface) (any, error) {
	count, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fail("DeviceGetCount", ret)
	}
	out := exportJSON{GPUs: []gpuExportJSON{}}
	for i := 0; i < count; i++ {
		g, err := exportGPU(lib, i)
		if err != nil {
			return nil, err
		}
		out.GPUs = append(out.GPUs, g)
	}
	return out, nil
}

func exportGPU(lib nvml.Interface, i int) (gpuExportJSON, error) {
	g := gpuExportJSON{Index: i, MigDevices: map[string]int{}, GpuInstances: []giJSON{}}
	dev, err := deviceByIndex(lib, i)
	if err != nil {
		return g, err
	}
	var ret nvml.Return
	if g.UUID, ret = dev.GetUUID(); ret != nvml.SUCCESS {
		return g, fail(fmt.Sprintf("GPU %d GetUUID", i), ret)
	}
	capable, current, _, err := migMode(dev, i)
	if err != nil || !capable {
		return g, err
	}
	g.MigCapable = true
	g.MigEnabled = current == nvml.DEVICE_MIG_ENABLE
	if !g.MigEnabled {
		return g, nil
	}
	total, err := memoryTotal(dev, fmt.Sprintf("GPU %d", i))
	if err != nil {
		return g, err
	}
	migs, err := migDevices(dev, i)
	if err != nil {
		return g, err
	}
	matched := map[int]bool{}
	err = walkGpuInstances(dev, func(gi nvml.GpuInstance, index int, info nvml.GpuInstanceProfileInfo) error {
		giInfo, ret := gi.GetInfo()
		if ret != nvml.SUCCESS {
			return fail(fmt.Sprintf("GPU %d GpuInstance.GetInfo (profile index %d)", i, index), ret)
		}
		gj := giJSON{
			ID: giInfo.Id, ProfileIndex: index, ProfileID: giInfo.ProfileId,
			Placement: placementJSON{giInfo.Placement.Start, giInfo.Placement.Size}, ComputeInstances: []ciJSON{},
		}
		err := walkComputeInstances(gi, func(ci nvml.ComputeInstance, j, k int, ciProfile nvml.ComputeInstanceProfileInfo) error {
			mp, err := newMigProfile(index, j, k, info.MemorySizeMB, total)
			if err != nil {
				return err
			}
			g.MigDevices[mp.String()]++
			ciInfo, ret := ci.GetInfo()
			if ret != nvml.SUCCESS {
				return fail(fmt.Sprintf("GPU %d GI %d ComputeInstance.GetInfo", i, giInfo.Id), ret)
			}
			cj := ciJSON{
				ID: ciInfo.Id, ProfileIndex: j, EngineProfile: k, ProfileID: ciInfo.ProfileId,
				Placement: placementJSON{ciInfo.Placement.Start, ciInfo.Placement.Size}, Name: mp.String(),
			}
			for n := range migs {
				if migs[n].GpuInstanceID == int(giInfo.Id) && migs[n].ComputeInstanceID == int(ciInfo.Id) {
					cj.MigDevice = &migs[n]
					matched[n] = true
					break
				}
			}
			gj.ComputeInstances = append(gj.ComputeInstances, cj)
			return nil
		})
		if err != nil {
			return err
		}
		g.GpuInstances = append(g.GpuInstances, gj)
		return nil
	})
	for n := range migs {
		if !matched[n] {
			g.UnmatchedMigDevices = append(g.UnmatchedMigDevices, migs[n])
		}
	}
	return g, err
}

// migDevices walks GetMigDeviceHandleByIndex(0..GetMaxMigDeviceCount-1) as go-nvlib's
// VisitMigDevices does (NOT_FOUND and INVALID_ARGUMENT skipped).
func migDevices(dev nvml.Device, i int) ([]migDeviceJSON, error) {
	maxMig, ret := dev.GetMaxMigDeviceCount()
	if ret != nvml.SUCCESS {
		return nil, fail(fmt.Sprintf("GPU %d GetMaxMigDeviceCount", i), ret)
	}
	var out []migDeviceJSON
	for n := 0; n < maxMig; n++ {
		mig, ret := dev.GetMigDeviceHandleByIndex(n)
		if ret == nvml.ERROR_NOT_FOUND || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue
		}
		if ret != nvml.SUCCESS {
			return nil, fail(fmt.Sprintf("GPU %d GetMigDeviceHandleByIndex(%d)", i, n), ret)
		}
		m := migDeviceJSON{Index: n}
		what := fmt.Sprintf("GPU %d MIG device %d", i, n)
		if m.UUID, ret = mig.GetUUID(); ret != nvml.SUCCESS {
			return nil, fail(what+" GetUUID", ret)
		}
		if m.GpuInstanceID, ret = mig.GetGpuInstanceId(); ret != nvml.SUCCESS {
			return nil, fail(what+" GetGpuInstanceId", ret)
		}
		if m.ComputeInstanceID, ret = mig.GetComputeInstanceId(); ret != nvml.SUCCESS {
			return nil, fail(what+" GetComputeInstanceId", ret)
		}
		var err error
		if m.MemoryTotalBytes, err = memoryTotal(mig, what); err != nil {
			return nil, err
		}
		out = append(out, m)
	}
	return out, nil
}

// ---------------------------------------------------------------------------------------------
// apply

type traceJSON struct {
	Call              string         `json:"call"`
	Profile           string         `json:"profile,omitempty"`
	ProfileID         *uint32        `json:"profileId,omitempty"`
	GpuInstanceID     *uint32        `json:"gpuInstanceId,omitempty"`
	ComputeInstanceID *uint32        `json:"computeInstanceId,omitempty"`
	Placement         *placementJSON `json:"placement,omitempty"`
	Ret               string         `json:"ret"`
}

type applyGPUJSON struct {
	Index            int            `json:"index"`
	Requested        map[string]int `json:"requested"`
	MigModeSet       bool           `json:"migModeSet"` // SetMigMode(ENABLE) was called
	ActivationStatus string         `json:"activationStatus,omitempty"`
	Skipped          string         `json:"skipped,omitempty"`
	Order            []string       `json:"order"`         // the ordering that succeeded
	Attempts         []string       `json:"attemptErrors"` // why earlier orderings failed
	Trace            []traceJSON    `json:"trace"`         // mutating calls, in order
}

func u32(v uint32) *uint32 { return &v }

func apply(lib nvml.Interface, file string, force bool) (any, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var spec struct {
		GPUs map[string]map[string]int `json:"gpus"`
	}
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&spec); err != nil {
		return nil, fmt.Errorf("%s: %v", file, err)
	}
	var indices []int
	for k := range spec.GPUs {
		n, err := strconv.Atoi(k)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("%s: GPU key %q is not an index", file, k)
		}
		indices = append(indices, n)
	}
	sort.Ints(indices)
	var results []applyGPUJSON
	for _, i := range indices {
		r, err := applyGPU(lib, i, spec.GPUs[strconv.Itoa(i)], force)
		results = append(results, r)
		if err != nil {
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			_ = enc.Encode(map[string]any{"applied": results})
			return nil, fmt.Errorf("GPU %d: %w", i, err)
		}
	}
	exp, err := export(lib)
	if err != nil {
		return nil, err
	}
	return map[string]any{"applied": results, "export": exp}, nil
}

func applyGPU(lib nvml.Interface, i int, config map[string]int, force bool) (applyGPUJSON, error) {
	r := applyGPUJSON{Index: i, Requested: config, Order: []string{}, Attempts: []string{}, Trace: []traceJSON{}}
	dev, err := deviceByIndex(lib, i)
	if err != nil {
		return r, err
	}
	capable, current, _, err := migMode(dev, i)
	if err != nil {
		return r, err
	}
	if !capable {
		return r, errors.New("cannot set MIG config on non MIG-capable GPU (GetMigMode: ERROR_NOT_SUPPORTED)")
	}
	if current != nvml.DEVICE_MIG_ENABLE {
		activation, ret := dev.SetMigMode(nvml.DEVICE_MIG_ENABLE)
		r.MigModeSet = true
		r.ActivationStatus = describe(activation)
		r.Trace = append(r.Trace, traceJSON{Call: "SetMigMode(NVML_DEVICE_MIG_ENABLE)", Ret: describe(ret)})
		if ret != nvml.SUCCESS {
			return r, fail("SetMigMode(NVML_DEVICE_MIG_ENABLE)", ret)
		}
		cur, pending, ret := dev.GetMigMode()
		if ret != nvml.SUCCESS {
			return r, fail("GetMigMode", ret)
		}
		if cur != nvml.DEVICE_MIG_ENABLE {
			return r, fmt.Errorf("MIG mode still disabled after SetMigMode (current %d, pending %d, activation %s): the GPU needs a reset",
				cur, pending, describe(activation))
		}
	}
	total, err := memoryTotal(dev, fmt.Sprintf("GPU %d", i))
	if err != nil {
		return r, err
	}
	available, err := deviceProfiles(dev, total)
	if err != nil {
		return r, err
	}
	// Flatten: one shared *migProfile per name (so permutations skip equal neighbours, as
	// mig-parted's pointer comparison does), largest G first, then largest C, then attributes.
	names := make([]string, 0, len(config))
	for name := range config {
		names = append(names, name)
	}
	sort.Strings(names)
	resolved := map[*migProfile]*migProfile{}
	var mps []*migProfile
	for _, name := range names {
		n := config[name]
		if n < 0 {
			return r, fmt.Errorf("negative count for %q", name)
		}
		p, err := parseMigProfile(name)
		if err != nil {
			return r, err
		}
		for _, a := range available {
			if a.matches(p) {
				resolved[p] = a
				break
			}
		}
		if resolved[p] == nil && n > 0 {
			return r, fmt.Errorf("MIG profile %q not found on this GPU", name)
		}
		for k := 0; k < n; k++ {
			mps = append(mps, p)
		}
	}
	sort.SliceStable(mps, func(a, b int) bool {
		if mps[a].G != mps[b].G {
			return mps[a].G > mps[b].G
		}
		if mps[a].C != mps[b].C {
			return mps[a].C > mps[b].C
		}
		return strings.Join(mps[a].Attrs, ",") > strings.Join(mps[b].Attrs, ",")
	})

	if !force {
		existing, err := getMigConfig(dev)
		if err != nil {
			return r, err
		}
		if configEqual(existing, config) {
			r.Skipped = "already set to desired value"
			return r, nil
		}
	}

	attempt := func(order []*migProfile) error {
		for clears := 0; ; clears++ {
			existing, err := getMigConfig(dev)
			if err != nil {
				return err
			}
			if configCount(existing) == 0 {
				break
			}
			if clears == 1 {
				return errors.New("exceeded maximum attempts to clear MigConfig")
			}
			if err := clearMigConfig(dev, &r.Trace); err != nil {
				return err
			}
		}
		lastGI := -1
		var gi nvml.GpuInstance
		for _, mp := range order {
			want := resolved[mp]
			giProfile, ret := dev.GetGpuInstanceProfileInfo(want.GIIndex)
			if ret != nvml.SUCCESS {
				return fail(fmt.Sprintf("GetGpuInstanceProfileInfo(%d) for %s", want.GIIndex, want), ret)
			}
			reuse := gi != nil && lastGI == want.GIIndex
			lastGI = want.GIIndex
			for {
				if !reuse {
					var ret nvml.Return
					gi, ret = dev.CreateGpuInstance(&giProfile)
					t := traceJSON{Call: "CreateGpuInstance", Profile: want.String(), ProfileID: u32(giProfile.Id), Ret: describe(ret)}
					if ret == nvml.SUCCESS {
						if info, ret := gi.GetInfo(); ret == nvml.SUCCESS {
							t.GpuInstanceID = u32(info.Id)
							t.Placement = &placementJSON{info.Placement.Start, info.Placement.Size}
						}
					}
					r.Trace = append(r.Trace, t)
					if ret != nvml.SUCCESS {
						return fail(fmt.Sprintf("CreateGpuInstance(profileId=%d) for %s", giProfile.Id, want), ret)
					}
				}
				ciProfile, ret := gi.GetComputeInstanceProfileInfo(want.CIIndex, want.EngIndex)
				if ret != nvml.SUCCESS {
					if reuse {
						reuse = false
						continue
					}
					return fail(fmt.Sprintf("GpuInstance.GetComputeInstanceProfileInfo(%d, %d) for %s", want.CIIndex, want.EngIndex, want), ret)
				}
				ci, ret := gi.CreateComputeInstance(&ciProfile)
				t := traceJSON{Call: "CreateComputeInstance", Profile: want.String(), ProfileID: u32(ciProfile.Id), Ret: describe(ret)}
				if info, r2 := gi.GetInfo(); r2 == nvml.SUCCESS {
					t.GpuInstanceID = u32(info.Id)
				}
				if ret == nvml.SUCCESS {
					if info, r2 := ci.GetInfo(); r2 == nvml.SUCCESS {
						t.ComputeInstanceID = u32(info.Id)
						t.Placement = &placementJSON{info.Placement.Start, info.Placement.Size}
					}
				}
				r.Trace = append(r.Trace, t)
				if ret != nvml.SUCCESS {
					if reuse {
						reuse = false
						continue
					}
					return fail(fmt.Sprintf("GpuInstance.CreateComputeInstance(profileId=%d) for %s", ciProfile.Id, want), ret)
				}
				valid, err := newMigProfile(want.GIIndex, want.CIIndex, want.EngIndex, giProfile.MemorySizeMB, total)
				if err != nil {
					return err
				}
				if !want.equals(valid) {
					if reuse {
						reuse = false
						continue
					}
					return fmt.Errorf("unsupported MIG device %s, expected %s", want, valid)
				}
				break
			}
		}
		return nil
	}

	err = permutations(mps, func(order []*migProfile) error {
		err := attempt(order)
		if err != nil {
			r.Attempts = append(r.Attempts, fmt.Sprintf("%s: %v", orderNames(order), err))
			return err
		}
		r.Order = orderNames(order)
		return nil
	})
	if err != nil {
		if e := clearMigConfig(dev, &r.Trace); e != nil {
			err = fmt.Errorf("%w (and clearing afterwards: %v)", err, e)
		}
		return r, err
	}
	return r, nil
}

func orderNames(order []*migProfile) []string {
	out := make([]string, len(order))
	for i, p := range order {
		out[i] = p.String()
	}
	return out
}

// permutations calls f on mps in its order, then on each distinct permutation (swaps of the same
// profile skipped), until f succeeds — mig-parted's iteratePermutationsUntilSuccess.
func permutations(mps []*migProfile, f func([]*migProfile) error) error {
	shouldSwap := func(start, curr int) bool {
		for i := start; i < curr; i++ {
			if mps[i] == mps[curr] {
				return false
			}
		}
		return true
	}
	var iterate func(i int) error
	iterate = func(i int) error {
		if i >= len(mps) {
			return f(mps)
		}
		for j := i; j < len(mps); j++ {
			if shouldSwap(i, j) {
				mps[i], mps[j] = mps[j], mps[i]
				if iterate(i+1) == nil {
					return nil
				}
				mps[i], mps[j] = mps[j], mps[i]
			}
		}
		return errors.New("all orderings failed")
	}
	return iterate(0)
}

func configCount(c map[string]int) int {
	n := 0
	for _, v := range c {
		if v > 0 {
			n += v
		}
	}
	return n
}

func configEqual(a, b map[string]int) bool {
	for k, v := range a {
		if v != b[k] {
			return false
		}
	}
	for k, v := range b {
		if v != a[k] {
			return false
		}
	}
	return true
}

// getMigConfig is mig-parted's GetMigConfig: profile name → count of compute instances.
func getMigConfig(dev nvml.Device) (map[string]int, error) {
	total, err := memoryTotal(dev, "GPU")
	if err != nil {
		return nil, err
	}
	current, _, ret := dev.GetMigMode()
	if ret != nvml.SUCCESS {
		return nil, fail("GetMigMode", ret)
	}
	if current != nvml.DEVICE_MIG_ENABLE {
		return nil, errors.New("MIG mode disabled")
	}
	config := map[string]int{}
	err = walkGpuInstances(dev, func(gi nvml.GpuInstance, index int, info nvml.GpuInstanceProfileInfo) error {
		return walkComputeInstances(gi, func(_ nvml.ComputeInstance, j, k int, _ nvml.ComputeInstanceProfileInfo) error {
			mp, err := newMigProfile(index, j, k, info.MemorySizeMB, total)
			if err != nil {
				return err
			}
			config[mp.String()]++
			return nil
		})
	})
	return config, err
}

// clearMigConfig is mig-parted's ClearMigConfig: every compute instance of a GI, then the GI.
func clearMigConfig(dev nvml.Device, trace *[]traceJSON) error {
	return walkGpuInstances(dev, func(gi nvml.GpuInstance, index int, _ nvml.GpuInstanceProfileInfo) error {
		var giID *uint32
		if info, ret := gi.GetInfo(); ret == nvml.SUCCESS {
			giID = u32(info.Id)
		}
		err := walkComputeInstances(gi, func(ci nvml.ComputeInstance, j, k int, _ nvml.ComputeInstanceProfileInfo) error {
			t := traceJSON{Call: "ComputeInstance.Destroy", GpuInstanceID: giID}
			if info, ret := ci.GetInfo(); ret == nvml.SUCCESS {
				t.ComputeInstanceID = u32(info.Id)
			}
			ret := ci.Destroy()
			t.Ret = describe(ret)
			*trace = append(*trace, t)
			if ret != nvml.SUCCESS {
				return fail(fmt.Sprintf("ComputeInstance.Destroy (profile (%d, %d))", j, k), ret)
			}
			return nil
		})
		if err != nil {
			return err
		}
		ret := gi.Destroy()
		*trace = append(*trace, traceJSON{Call: "GpuInstance.Destroy", GpuInstanceID: giID, Ret: describe(ret)})
		if ret != nvml.SUCCESS {
			return fail(fmt.Sprintf("GpuInstance.Destroy (profile index %d)", index), ret)
		}
		return nil
	})
}

// ---------------------------------------------------------------------------------------------
// raw C calls (conformance only)

func rawSymbol(names ...string) (unsafe.Pointer, error) {
	for _, name := range names {
		cname := C.CString(name)
		p := C.gonvml_sym(cname)
		C.free(unsafe.Pointer(cname))
		if p != nil {
			return p, nil
		}
	}
	return nil, fmt.Errorf("dlsym: %s not exported", strings.Join(names, "/"))
}

func rawDevice(index int) (uintptr, nvml.Return, error) {
	fn, err := rawSymbol("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex")
	if err != nil {
		return 0, 0, err
	}
	var out C.uintptr_t
	ret := nvml.Return(C.gonvml_handle_by_index(fn, C.uint(index), &out))
	return uintptr(out), ret, nil
}

// rawByID calls one of the (parent handle, unsigned int, handle *) calls: *GetGpuInstanceById,
// *GetComputeInstanceById, nvmlDeviceGetMigDeviceHandleByIndex.
func rawByID(symbol string, parent uintptr, id uint32) (uintptr, nvml.Return, error) {
	fn, err := rawSymbol(symbol)
	if err != nil {
		return 0, 0, err
	}
	var out C.uintptr_t
	ret := nvml.Return(C.gonvml_by_id(fn, C.uintptr_t(parent), C.uint(id), &out))
	return uintptr(out), ret, nil
}

// rawList calls nvmlDeviceGetGpuInstances / nvmlGpuInstanceGetComputeInstances with a buffer of
// bufLen handles and *count = countIn; it returns *count afterwards.
func rawList(symbol string, parent uintptr, profileID, bufLen, countIn uint32) (uint32, nvml.Return, error) {
	fn, err := rawSymbol(symbol)
	if err != nil {
		return 0, 0, err
	}
	n := bufLen
	if n == 0 {
		n = 1
	}
	buf := (*unsafe.Pointer)(C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof(unsafe.Pointer(nil)))))
	defer C.free(unsafe.Pointer(buf))
	count := C.uint(countIn)
	ret := nvml.Return(C.gonvml_list(fn, C.uintptr_t(parent), C.uint(profileID), buf, &count))
	return uint32(count), ret, nil
}

// rawPlacementCount calls nvmlDeviceGetGpuInstancePossiblePlacements_v2 with placements = NULL.
func rawPlacementCount(dev uintptr, profileID uint32) (uint32, nvml.Return, error) {
	fn, err := rawSymbol("nvmlDeviceGetGpuInstancePossiblePlacements_v2", "nvmlDeviceGetGpuInstancePossiblePlacements")
	if err != nil {
		return 0, 0, err
	}
	var count C.uint
	ret := nvml.Return(C.gonvml_placements(fn, C.uintptr_t(dev), C.uint(profileID), nil, &count))
	return uint32(count), ret, nil
}

// ---------------------------------------------------------------------------------------------
// conformance

type row struct {
	Call       string `json:"call"`
	Documented string `json:"documented"`
	Got        string `json:"got"`
	OK         bool   `json:"ok"`
}

type checker struct{ rows []row }

// minLegalPointer is the Go runtime's: a pointer-typed slot holding 1..4095 makes it throw
// "invalid pointer found on stack" when it copies a goroutine stack, and go-nvml keeps every
// handle in a pointer-typed field (nvmlDevice{Handle *C.struct_nvmlDevice_st}, ...).
const minLegalPointer = 4096

const handleDoc = "not NVML documentation: handles are opaque pointers (real NVML hands out addresses); go-nvml stores them in Go pointer-typed fields, where Go's runtime throws \"invalid pointer found on stack\" on values 1..4095, so every handle must be 0 or >= 4096"

func (c *checker) add(call, documented string, ok bool, got string, args ...any) bool {
	c.rows = append(c.rows, row{Call: call, Documented: documented, Got: fmt.Sprintf(got, args...), OK: ok})
	return ok
}

func conformance(lib nvml.Interface) ([]row, error) {
	c := &checker{}
	dev, err := deviceByIndex(lib, 0)
	if err != nil {
		return nil, err
	}
	uuid, ret := dev.GetUUID()
	if ret != nvml.SUCCESS {
		return nil, fail("GPU 0 GetUUID", ret)
	}
	current, _, ret := dev.GetMigMode()
	if !c.add("GetMigMode (GPU 0)", "precondition: the caller put GPU 0 in MIG mode (currentMode NVML_DEVICE_MIG_ENABLE)",
		ret == nvml.SUCCESS && current == nvml.DEVICE_MIG_ENABLE, "%s, current %d", describe(ret), current) {
		return c.rows, nil
	}
	existing, err := getMigConfig(dev)
	empty := err == nil && configCount(existing) == 0
	if err == nil {
		// Also count GPU instances without compute instances.
		_ = walkGpuInstances(dev, func(nvml.GpuInstance, int, nvml.GpuInstanceProfileInfo) error {
			empty = false
			return nil
		})
	}
	if !c.add("GetGpuInstances (every supported profile, GPU 0)", "precondition: GPU 0 has no GPU instances",
		empty, "config %v, err %v", existing, err) {
		return c.rows, nil
	}

	var created []nvml.GpuInstance
	var createdCI []nvml.ComputeInstance
	conformanceChecks(c, dev, uuid, &created, &createdCI)

	// Cleanup: what this run created (compute instances first), then a mig-parted style sweep.
	var problems []string
	for _, ci := range createdCI {
		if ret := ci.Destroy(); ret != nvml.SUCCESS && ret != nvml.ERROR_INVALID_ARGUMENT && ret != nvml.ERROR_NOT_FOUND {
			problems = append(problems, "ComputeInstance.Destroy: "+describe(ret))
		}
	}
	for _, gi := range created {
		if ret := gi.Destroy(); ret != nvml.SUCCESS && ret != nvml.ERROR_INVALID_ARGUMENT && ret != nvml.ERROR_NOT_FOUND {
			problems = append(problems, "GpuInstance.Destroy: "+describe(ret))
		}
	}
	var trace []traceJSON
	if err := clearMigConfig(dev, &trace); err != nil {
		problems = append(problems, "sweep: "+err.Error())
	}
	if len(trace) > 0 {
		problems = append(problems, fmt.Sprintf("the sweep still found %d instances to destroy", len(trace)))
	}
	left := 0
	err = walkGpuInstances(dev, func(nvml.GpuInstance, int, nvml.GpuInstanceProfileInfo) error {
		left++
		return nil
	})
	if err != nil {
		problems = append(problems, err.Error())
	}
	c.add("cleanup: Destroy everything created, then GetGpuInstances (every profile)",
		"GPU 0 is left with no GPU instances", len(problems) == 0 && left == 0,
		"%d GPU instances left; %s", left, strings.Join(problems, "; "))
	return c.rows, nil
}

func conformanceChecks(c *checker, dev nvml.Device, uuid string, created *[]nvml.GpuInstance, createdCI *[]nvml.ComputeInstance) {
	total, err := memoryTotal(dev, "GPU 0")
	if !c.add("GetMemoryInfo (GPU 0)", "NVML_SUCCESS; total memory in bytes", err == nil, "total %d, err %v", total, err) {
		return
	}
	const index = nvml.GPU_INSTANCE_PROFILE_1_SLICE
	info, ret := dev.GetGpuInstanceProfileInfo(index)
	if !c.add("GetGpuInstanceProfileInfo(NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0)",
		"NVML_SUCCESS; info.id is the profile ID that CreateGpuInstance and the other profileId calls take — not the index (19 for 1g on A100/H100/H200)",
		ret == nvml.SUCCESS && info.SliceCount == 1 && info.InstanceCount > 0 && info.Id != index,
		"%s: id %d, sliceCount %d, instanceCount %d, memorySizeMB %d, multiprocessorCount %d",
		describe(ret), info.Id, info.SliceCount, info.InstanceCount, info.MemorySizeMB, info.MultiprocessorCount) {
		return
	}
	v2, ret := dev.GetGpuInstanceProfileInfoV(index).V2()
	v2Name := cString(v2.Name[:])
	c.add("GetGpuInstanceProfileInfoV(0) with nvmlGpuInstanceProfileInfo_v2",
		"NVML_SUCCESS (version field set by the caller); the same profile as the v1 call, plus its name",
		ret == nvml.SUCCESS && v2.Id == info.Id && v2.SliceCount == info.SliceCount &&
			v2.InstanceCount == info.InstanceCount && v2.MemorySizeMB == info.MemorySizeMB && v2Name != "",
		"%s: id %d, sliceCount %d, instanceCount %d, memorySizeMB %d, name %q",
		describe(ret), v2.Id, v2.SliceCount, v2.InstanceCount, v2.MemorySizeMB, v2Name)

	// mig-parted's names against the driver's (all supported profiles).
	var mismatches, pairs []string
	for p := 0; p < nvml.GPU_INSTANCE_PROFILE_COUNT; p++ {
		pi, ret := dev.GetGpuInstanceProfileInfo(p)
		if ret != nvml.SUCCESS {
			continue
		}
		full, _ := fullComputeIndex(int(pi.SliceCount))
		mp, err := newMigProfile(p, full, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, pi.MemorySizeMB, total)
		pv2, ret := dev.GetGpuInstanceProfileInfoV(p).V2()
		if err != nil || ret != nvml.SUCCESS {
			mismatches = append(mismatches, fmt.Sprintf("index %d: %v %s", p, err, describe(ret)))
			continue
		}
		name := cString(pv2.Name[:])
		pairs = append(pairs, fmt.Sprintf("%d:%s", p, name))
		if name != "MIG "+mp.String() {
			mismatches = append(mismatches, fmt.Sprintf("index %d: driver %q, mig-parted %q", p, name, mp.String()))
		}
	}
	c.add("GetGpuInstanceProfileInfoV(every index).name vs mig-parted's derived name",
		"not NVML documentation: the driver names a profile \"MIG Ng.XXgb[+me]\"; mig-parted derives Ng.XXgb from the profile index and memorySizeMB against GetMemoryInfo().total",
		len(mismatches) == 0, "%s; mismatches: %s", strings.Join(pairs, ", "), strings.Join(mismatches, "; "))

	_, ret = dev.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_COUNT)
	c.add(fmt.Sprintf("GetGpuInstanceProfileInfo(NVML_GPU_INSTANCE_PROFILE_COUNT = %d)", nvml.GPU_INSTANCE_PROFILE_COUNT),
		"NVML_ERROR_INVALID_ARGUMENT if profile is invalid (profiles are enumerated from 0 until INVALID_ARGUMENT)",
		ret == nvml.ERROR_INVALID_ARGUMENT, "%s", describe(ret))

	rawDev, ret, err := rawDevice(0)
	if !c.add("nvmlDeviceGetHandleByIndex_v2(0) (raw C call, for the rows go-nvml cannot express)",
		"NVML_SUCCESS", err == nil && ret == nvml.SUCCESS && rawDev != 0, "%s %v", describe(ret), err) {
		return
	}
	c.add("handle value of GPU 0 (nvmlDevice_t)", handleDoc, rawDev >= minLegalPointer, "%#x", rawDev)
	rawCount, ret, err := rawPlacementCount(rawDev, info.Id)
	c.add(fmt.Sprintf("nvmlDeviceGetGpuInstancePossiblePlacements_v2(profileId=%d, placements=NULL, &count) (raw)", info.Id),
		"placements \"can be NULL to discover number of allowed placements for this profile\"; count returns that number",
		err == nil && ret == nvml.SUCCESS && rawCount > 0, "%s, count %d %v", describe(ret), rawCount, err)
	placements, ret := dev.GetGpuInstancePossiblePlacements(&info)
	starts := map[uint32]bool{}
	sizesOK := true
	for _, p := range placements {
		starts[p.Start] = true
		sizesOK = sizesOK && p.Size == 1
	}
	c.add(fmt.Sprintf("GetGpuInstancePossiblePlacements(profileId=%d) (go-nvml: NULL for the count, then a buffer of count)", info.Id),
		"NVML_SUCCESS; \"Returns placements allowed for the profile\"",
		ret == nvml.SUCCESS && len(placements) > 0 && uint32(len(placements)) == rawCount && len(starts) == len(placements) && sizesOK,
		"%s: %v", describe(ret), placements)
	possible := func(p nvml.GpuInstancePlacement) bool {
		for _, q := range placements {
			if q == p {
				return true
			}
		}
		return false
	}

	cap0, ret := dev.GetGpuInstanceRemainingCapacity(&info)
	c.add(fmt.Sprintf("GetGpuInstanceRemainingCapacity(profileId=%d) on the empty GPU", info.Id),
		"NVML_SUCCESS; \"Returns remaining instance count for the profile ID\" (all of instanceCount while nothing exists)",
		ret == nvml.SUCCESS && uint32(cap0) == info.InstanceCount, "%s: %d (instanceCount %d)", describe(ret), cap0, info.InstanceCount)

	gi, ret := dev.CreateGpuInstance(&info)
	if !c.add(fmt.Sprintf("CreateGpuInstance(profileId=%d) (no placement, as mig-parted creates)", info.Id),
		"NVML_SUCCESS; returns the GPU instance handle", ret == nvml.SUCCESS, "%s", describe(ret)) {
		return
	}
	*created = append(*created, gi)
	giInfo, ret := gi.GetInfo()
	if !c.add("GpuInstance.GetInfo()",
		"NVML_SUCCESS; profileId is the ID it was created with; its placement is one of the possible placements (size 1 for 1g)",
		ret == nvml.SUCCESS && giInfo.ProfileId == info.Id && giInfo.Placement.Size == 1 && possible(giInfo.Placement),
		"%s: id %d, profileId %d, placement %+v", describe(ret), giInfo.Id, giInfo.ProfileId, giInfo.Placement) {
		return
	}
	cap1, ret := dev.GetGpuInstanceRemainingCapacity(&info)
	c.add(fmt.Sprintf("GetGpuInstanceRemainingCapacity(profileId=%d) after one create", info.Id),
		"NVML_SUCCESS; the remaining count, one less", ret == nvml.SUCCESS && cap1 == cap0-1, "%s: %d (before %d)", describe(ret), cap1, cap0)

	gis, ret := dev.GetGpuInstances(&info)
	var ids []uint32
	for _, g := range gis {
		gInfo, _ := g.GetInfo()
		ids = append(ids, gInfo.Id)
	}
	c.add(fmt.Sprintf("GetGpuInstances(profileId=%d) (go-nvml: buffer and *count of info.instanceCount)", info.Id),
		"NVML_SUCCESS; the buffer \"must be large enough to accommodate the instances supported by the profile\"; count: \"The count of returned GPU instances\"",
		ret == nvml.SUCCESS && len(ids) == 1 && ids[0] == giInfo.Id, "%s: ids %v", describe(ret), ids)
	n, ret, err := rawList("nvmlDeviceGetGpuInstances", rawDev, info.Id, info.InstanceCount, 0)
	c.add(fmt.Sprintf("nvmlDeviceGetGpuInstances(profileId=%d, buffer[instanceCount], *count = 0) (raw)", info.Id),
		"NVML_SUCCESS; count is an output (\"The count of returned GPU instances\"), the buffer is sized by instanceCount",
		err == nil && ret == nvml.SUCCESS && n == 1, "%s, count %d %v", describe(ret), n, err)

	byID, ret := dev.GetGpuInstanceById(int(giInfo.Id))
	var byIDInfo nvml.GpuInstanceInfo
	if ret == nvml.SUCCESS {
		byIDInfo, ret = byID.GetInfo()
	}
	c.add(fmt.Sprintf("GetGpuInstanceById(%d)", giInfo.Id), "NVML_SUCCESS; the GPU instance with that ID",
		ret == nvml.SUCCESS && byIDInfo.Id == giInfo.Id && byIDInfo.ProfileId == info.Id,
		"%s: id %d, profileId %d", describe(ret), byIDInfo.Id, byIDInfo.ProfileId)

	ciIndex, _ := fullComputeIndex(1)
	ciProfile, ret := gi.GetComputeInstanceProfileInfo(ciIndex, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	if !c.add("GpuInstance.GetComputeInstanceProfileInfo(NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)",
		"NVML_SUCCESS; the compute profile spanning the whole 1-slice GI (the one mig-parted uses for \"1g.XXgb\")",
		ret == nvml.SUCCESS && ciProfile.SliceCount == 1 && ciProfile.InstanceCount >= 1,
		"%s: id %d, sliceCount %d, instanceCount %d, multiprocessorCount %d",
		describe(ret), ciProfile.Id, ciProfile.SliceCount, ciProfile.InstanceCount, ciProfile.MultiprocessorCount) {
		return
	}
	ci, ret := gi.CreateComputeInstance(&ciProfile)
	if !c.add(fmt.Sprintf("GpuInstance.CreateComputeInstance(profileId=%d)", ciProfile.Id),
		"NVML_SUCCESS; returns the compute instance handle", ret == nvml.SUCCESS, "%s", describe(ret)) {
		return
	}
	*createdCI = append(*createdCI, ci)
	extra, ret := gi.CreateComputeInstance(&ciProfile)
	if ret == nvml.SUCCESS {
		*createdCI = append(*createdCI, extra)
	}
	c.add(fmt.Sprintf("GpuInstance.CreateComputeInstance(profileId=%d) again, the GI's compute slices taken", ciProfile.Id),
		"NVML_ERROR_INSUFFICIENT_RESOURCES \"If the requested compute instance could not be created\" (mig-parted relies on this failing to move on to a new GI)",
		ret == nvml.ERROR_INSUFFICIENT_RESOURCES, "%s", describe(ret))

	cis, ret := gi.GetComputeInstances(&ciProfile)
	c.add(fmt.Sprintf("GpuInstance.GetComputeInstances(profileId=%d) (go-nvml: buffer and *count of info.instanceCount)", ciProfile.Id),
		"NVML_SUCCESS; count: \"The count of returned compute instances\"", ret == nvml.SUCCESS && len(cis) == 1,
		"%s: %d compute instances", describe(ret), len(cis))
	rawGI, ret, err := rawByID("nvmlDeviceGetGpuInstanceById", rawDev, giInfo.Id)
	if err == nil && ret == nvml.SUCCESS {
		n, ret, err = rawList("nvmlGpuInstanceGetComputeInstances", rawGI, ciProfile.Id, ciProfile.InstanceCount, 0)
	}
	c.add(fmt.Sprintf("nvmlGpuInstanceGetComputeInstances(profileId=%d, buffer[instanceCount], *count = 0) (raw)", ciProfile.Id),
		"NVML_SUCCESS; count is an output, the buffer is sized by the compute profile's instanceCount",
		err == nil && ret == nvml.SUCCESS && n == 1, "%s, count %d %v", describe(ret), n, err)

	ciInfo, ret := ci.GetInfo()
	if !c.add("ComputeInstance.GetInfo() of the created compute instance", "NVML_SUCCESS",
		ret == nvml.SUCCESS && ciInfo.ProfileId == ciProfile.Id, "%s: id %d, profileId %d, placement %+v",
		describe(ret), ciInfo.Id, ciInfo.ProfileId, ciInfo.Placement) {
		return
	}
	byCI, ret := gi.GetComputeInstanceById(int(ciInfo.Id))
	var got nvml.ComputeInstanceInfo
	if ret == nvml.SUCCESS {
		got, ret = byCI.GetInfo()
	}
	parentUUID, gotGI := "", uint32(0)
	if ret == nvml.SUCCESS && got.Device != nil {
		parentUUID, _ = got.Device.GetUUID()
	}
	if ret == nvml.SUCCESS && got.GpuInstance != nil {
		gInfo, _ := got.GpuInstance.GetInfo()
		gotGI = gInfo.Id
	}
	c.add(fmt.Sprintf("GpuInstance.GetComputeInstanceById(%d) then ComputeInstance.GetInfo()", ciInfo.Id),
		"NVML_SUCCESS; the compute instance: its id, profileId, parent device and GPU instance",
		ret == nvml.SUCCESS && got.Id == ciInfo.Id && got.ProfileId == ciProfile.Id && parentUUID == uuid && gotGI == giInfo.Id,
		"%s: id %d, profileId %d, device %s, gpuInstance %d, placement %+v",
		describe(ret), got.Id, got.ProfileId, parentUUID, gotGI, got.Placement)

	ret = gi.Destroy()
	if ret == nvml.SUCCESS {
		c.add("GpuInstance.Destroy() while a compute instance exists",
			"NVML_ERROR_IN_USE \"If the GPU instance is in use ... compute instances are active on the GPU instance\"",
			false, "%s (the GPU instance is gone; the remaining rows are skipped)", describe(ret))
		return
	}
	c.add("GpuInstance.Destroy() while a compute instance exists",
		"NVML_ERROR_IN_USE \"If the GPU instance is in use ... compute instances are active on the GPU instance\"",
		ret == nvml.ERROR_IN_USE, "%s", describe(ret))

	// MIG device handles.
	maxMig, ret := dev.GetMaxMigDeviceCount()
	c.add("GetMaxMigDeviceCount (GPU 0)", "NVML_SUCCESS; the maximum number of MIG devices under the parent",
		ret == nvml.SUCCESS && maxMig >= 1, "%s: %d", describe(ret), maxMig)
	mig, ret := dev.GetMigDeviceHandleByIndex(0)
	if !c.add("GetMigDeviceHandleByIndex(0) with one compute instance", "NVML_SUCCESS; the MIG device handle",
		ret == nvml.SUCCESS, "%s", describe(ret)) {
		return
	}
	isMig, ret := mig.IsMigDeviceHandle()
	c.add("IsMigDeviceHandle(MIG device)", "NVML_SUCCESS; isMigDevice true", ret == nvml.SUCCESS && isMig, "%s: %v", describe(ret), isMig)
	isMig, ret = dev.IsMigDeviceHandle()
	c.add("IsMigDeviceHandle(GPU 0)", "NVML_SUCCESS; isMigDevice false", ret == nvml.SUCCESS && !isMig, "%s: %v", describe(ret), isMig)
	parent, ret := mig.GetDeviceHandleFromMigDeviceHandle()
	parentUUID = ""
	if ret == nvml.SUCCESS {
		parentUUID, ret = parent.GetUUID()
	}
	c.add("GetDeviceHandleFromMigDeviceHandle(MIG device)", "NVML_SUCCESS; the parent device handle (GPU 0)",
		ret == nvml.SUCCESS && parentUUID == uuid, "%s: parent %s (GPU 0 is %s)", describe(ret), parentUUID, uuid)
	giID, ret := mig.GetGpuInstanceId()
	c.add("GetGpuInstanceId(MIG device)", "NVML_SUCCESS; the GPU instance ID", ret == nvml.SUCCESS && giID == int(giInfo.Id),
		"%s: %d (created %d)", describe(ret), giID, giInfo.Id)
	ciID, ret := mig.GetComputeInstanceId()
	c.add("GetComputeInstanceId(MIG device)", "NVML_SUCCESS; the compute instance ID", ret == nvml.SUCCESS && ciID == int(ciInfo.Id),
		"%s: %d (created %d)", describe(ret), ciID, ciInfo.Id)
	migMem, ret := mig.GetMemoryInfo()
	c.add("GetMemoryInfo(MIG device)",
		"NVML_SUCCESS; \"Per-instance information can be queried by using specific MIG device handles\": the profile's memorySizeMB",
		ret == nvml.SUCCESS && migMem.Total == info.MemorySizeMB*mib, "%s: total %d bytes (profile %d MiB = %d bytes)",
		describe(ret), migMem.Total, info.MemorySizeMB, info.MemorySizeMB*mib)
	migUUID, ret := mig.GetUUID()
	c.add("GetUUID(MIG device)", "NVML_SUCCESS; the MIG device's own UUID (MIG-…)",
		ret == nvml.SUCCESS && strings.HasPrefix(migUUID, "MIG-") && migUUID != uuid, "%s: %s", describe(ret), migUUID)
	rawCI, ret1, err1 := uintptr(0), nvml.SUCCESS, error(nil)
	if rawGI != 0 {
		rawCI, ret1, err1 = rawByID("nvmlGpuInstanceGetComputeInstanceById", rawGI, ciInfo.Id)
	}
	rawMig, ret2, err2 := rawByID("nvmlDeviceGetMigDeviceHandleByIndex", rawDev, 0)
	c.add("handle values of the GPU instance, compute instance and MIG device (nvmlGpuInstance_t, nvmlComputeInstance_t, nvmlDevice_t)",
		handleDoc, rawGI >= minLegalPointer && rawCI >= minLegalPointer && rawMig >= minLegalPointer &&
			ret1 == nvml.SUCCESS && ret2 == nvml.SUCCESS && err1 == nil && err2 == nil,
		"GI %#x, CI %#x (%s %v), MIG device %#x (%s %v)", rawGI, rawCI, describe(ret1), err1, rawMig, describe(ret2), err2)
	if maxMig > 1 {
		_, ret = dev.GetMigDeviceHandleByIndex(1)
		c.add("GetMigDeviceHandleByIndex(1) with one MIG device",
			"NVML_ERROR_NOT_FOUND \"if no valid MIG device was found at index\"", ret == nvml.ERROR_NOT_FOUND, "%s", describe(ret))
	}

	// Fill the profile to capacity, then one more.
	var fillStarts []uint32
	fillOK := true
	for k := 0; k < cap0-1; k++ {
		g, ret := dev.CreateGpuInstance(&info)
		if ret != nvml.SUCCESS {
			fillOK = false
			fillStarts = append(fillStarts, math.MaxUint32)
			break
		}
		*created = append(*created, g)
		gInfo, ret := g.GetInfo()
		fillOK = fillOK && ret == nvml.SUCCESS && possible(gInfo.Placement)
		fillStarts = append(fillStarts, gInfo.Placement.Start)
	}
	seen := map[uint32]bool{giInfo.Placement.Start: true}
	for _, s := range fillStarts {
		fillOK = fillOK && !seen[s]
		seen[s] = true
	}
	left, ret := dev.GetGpuInstanceRemainingCapacity(&info)
	c.add(fmt.Sprintf("CreateGpuInstance(profileId=%d) × %d more, then GetGpuInstanceRemainingCapacity", info.Id, cap0-1),
		"each NVML_SUCCESS at a distinct possible placement; remaining count 0 afterwards",
		fillOK && ret == nvml.SUCCESS && left == 0, "starts %d then %v; remaining %d (%s)", giInfo.Placement.Start, fillStarts, left, describe(ret))
	over, ret := dev.CreateGpuInstance(&info)
	if ret == nvml.SUCCESS {
		*created = append(*created, over)
	}
	c.add(fmt.Sprintf("CreateGpuInstance(profileId=%d) beyond capacity", info.Id),
		"NVML_ERROR_INSUFFICIENT_RESOURCES \"If the requested GPU instance could not be created\"",
		ret == nvml.ERROR_INSUFFICIENT_RESOURCES, "%s", describe(ret))

	// Tear down what was created, through the documented calls.
	var destroyErrs []string
	for _, g := range (*created)[1:] {
		if ret := g.Destroy(); ret != nvml.SUCCESS {
			destroyErrs = append(destroyErrs, describe(ret))
		}
	}
	*created = (*created)[:1]
	c.add("GpuInstance.Destroy() of the GPU instances without compute instances", "NVML_SUCCESS",
		len(destroyErrs) == 0, "%v", destroyErrs)
	ret = ci.Destroy()
	if ret == nvml.SUCCESS {
		*createdCI = (*createdCI)[:0]
	}
	c.add("ComputeInstance.Destroy()", "NVML_SUCCESS", ret == nvml.SUCCESS, "%s", describe(ret))
	ret = gi.Destroy()
	if ret == nvml.SUCCESS {
		*created = (*created)[:0]
	}
	c.add("GpuInstance.Destroy() once its compute instance is gone", "NVML_SUCCESS", ret == nvml.SUCCESS, "%s", describe(ret))
	_, ret = dev.GetGpuInstanceById(int(giInfo.Id))
	c.add(fmt.Sprintf("GetGpuInstanceById(%d) after Destroy", giInfo.Id),
		"NVML_ERROR_NOT_FOUND \"If the GPU instance is not found\"", ret == nvml.ERROR_NOT_FOUND, "%s", describe(ret))
	capEnd, ret := dev.GetGpuInstanceRemainingCapacity(&info)
	c.add(fmt.Sprintf("GetGpuInstanceRemainingCapacity(profileId=%d) after the destroys", info.Id),
		"NVML_SUCCESS; back to the empty GPU's count", ret == nvml.SUCCESS && capEnd == cap0, "%s: %d (empty %d)", describe(ret), capEnd, cap0)
}
