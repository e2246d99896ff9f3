// Command testruntime is the container runtime of the kubelet tests: the kubelet's fake CRI
// server (k8s.io/cri-client/pkg/fake) with two additions a real runtime has.
//
//   - CDI: every CreateContainer's CDI device ids are resolved with the CDI library runtimes use
//     (tags.cncf.io/container-device-interface), each spec file they come from is validated
//     against the CDI JSON schema (cdi-schema/, from the CDI repository), and what was asked and
//     resolved is written to <records>/<container id>.json. An unknown id or an invalid spec fails
//     CreateContainer, as it would under containerd.
//   - Processes: StartContainer runs the container's command as a local process with the CDI
//     edits applied: the environment, the mounts inside a private mount namespace (over a fresh
//     /run and a private copy of /etc), in a cgroup path naming the pod's UID as the kubelet's
//     cgroup layout would. Its output goes to <records>/<container id>.log; when it exits the
//     container is reported exited with its code.
//
// Usage: testruntime --endpoint unix:///path/cri.sock --records DIR --cdi-dir DIR --scratch DIR
package main

import (
	"context"
	"embed"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/xeipuuv/gojsonschema"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	kubeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
	"k8s.io/cri-client/pkg/util"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

//go:embed cdi-schema/schema.json cdi-schema/defs.json
var schemaFiles embed.FS

// The cgroup hierarchy (v1) the containers' processes are put in; the agent reads a pod's UID
// from a process's cgroup path.
const cgroupRoot = "/sys/fs/cgroup/pids/gpuslice-testruntime"

// record is what the runtime writes for each created container.
type record struct {
	ID         string      `json:"id"`
	Namespace  string      `json:"namespace"`
	Pod        string      `json:"pod"`
	PodUID     string      `json:"podUID"`
	Container  string      `json:"container"`
	CDIDevices []string    `json:"cdiDevices"`
	CDISpecs   []string    `json:"cdiSpecs"`
	Command    []string    `json:"command"`
	Env        []string    `json:"env"`
	Mounts     []oci.Mount `json:"mounts"`
	Started    bool        `json:"started"`
	ExitCode   *int        `json:"exitCode,omitempty"`
	Error      string      `json:"error,omitempty"`
}

type runtime struct {
	*fake.RemoteRuntime
	records string
	scratch string
	cdi     *cdi.Cache
	schema  *gojsonschema.Schema

	mu         sync.Mutex
	containers map[string]*record
	processes  map[string]*exec.Cmd
}

func (r *runtime) write(rec *record) {
	data, _ := json.MarshalIndent(rec, "", "  ")
	tmp := filepath.Join(r.records, "."+rec.ID+".json")
	if err := os.WriteFile(tmp, data, 0o644); err == nil {
		_ = os.Rename(tmp, filepath.Join(r.records, rec.ID+".json"))
	}
}

// validate checks a CDI spec file against the CDI JSON schema.
func (r *runtime) validate(path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	result, err := r.schema.Validate(gojsonschema.NewBytesLoader(raw))
	if err != nil {
		return fmt.Errorf("%s: %v", path, err)
	}
	if !result.Valid() {
		var problems []string
		for _, e := range result.Errors() {
			problems = append(problems, e.String())
		}
		return fmt.Errorf("%s does not match the CDI schema: %s", path, strings.Join(problems, "; "))
	}
	return nil
}

func (r *runtime) CreateContainer(ctx context.Context, req *kubeapi.CreateContainerRequest) (*kubeapi.CreateContainerResponse, error) {
	config, sandbox := req.GetConfig(), req.GetSandboxConfig()
	rec := &record{
		Namespace: sandbox.GetMetadata().GetNamespace(),
		Pod:       sandbox.GetMetadata().GetName(),
		PodUID:    sandbox.GetMetadata().GetUid(),
		Container: config.GetMetadata().GetName(),
		Command:   append(append([]string{}, config.GetCommand()...), config.GetArgs()...),
	}
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	for _, kv := range config.GetEnvs() {
		spec.Process.Env = append(spec.Process.Env, kv.GetKey()+"="+string(kv.GetValue()))
	}
	for _, d := range config.GetCDIDevices() {
		rec.CDIDevices = append(rec.CDIDevices, d.GetName())
	}
	if len(rec.CDIDevices) > 0 {
		if err := r.cdi.Refresh(); err != nil {
			log.Printf("CDI refresh: %v", err)
		}
		if _, err := r.cdi.InjectDevices(spec, rec.CDIDevices...); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "CDI devices %v: %v", rec.CDIDevices, err)
		}
		seen := map[string]bool{}
		for _, id := range rec.CDIDevices {
			path := r.cdi.GetDevice(id).GetSpec().GetPath()
			if seen[path] {
				continue
			}
			seen[path] = true
			if err := r.validate(path); err != nil {
				return nil, status.Errorf(codes.InvalidArgument, "CDI device %s: %v", id, err)
			}
			rec.CDISpecs = append(rec.CDISpecs, path)
		}
	}
	rec.Env, rec.Mounts = spec.Process.Env, spec.Mounts
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	rec.ID = resp.GetContainerId()
	r.mu.Lock()
	r.containers[rec.ID] = rec
	r.mu.Unlock()
	r.write(rec)
	log.Printf("created %s/%s %s: CDI %v", rec.Namespace, rec.Pod, rec.Container, rec.CDIDevices)
	return resp, nil
}

func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// script is the shell that becomes the container's process: it joins the pod's cgroup, sets up
// the mounts in its private mount namespace and execs the command with the environment.
func (r *runtime) script(rec *record, etc string) string {
	cgroup := filepath.Join(cgroupRoot, "pod"+rec.PodUID, rec.ID)
	var b strings.Builder
	fmt.Fprintf(&b, "set -e; mkdir -p %[1]s; echo $$ > %[1]s/cgroup.procs; ", quote(cgroup))
	fmt.Fprintf(&b, "mount -t tmpfs none /run; mount --bind %s /etc; ", quote(etc))
	for _, m := range rec.Mounts {
		if info, err := os.Stat(m.Source); err == nil && info.IsDir() {
			fmt.Fprintf(&b, "mkdir -p %s; ", quote(m.Destination))
		} else {
			fmt.Fprintf(&b, "mkdir -p \"$(dirname %[1]s)\"; [ -e %[1]s ] || touch %[1]s; ", quote(m.Destination))
		}
		fmt.Fprintf(&b, "mount --bind %s %s; ", quote(m.Source), quote(m.Destination))
		for _, o := range m.Options {
			if o == "ro" {
				fmt.Fprintf(&b, "mount -o remount,bind,ro %s; ", quote(m.Destination))
			}
		}
	}
	b.WriteString("exec env -i")
	for _, e := range rec.Env {
		b.WriteString(" " + quote(e))
	}
	for _, a := range rec.Command {
		b.WriteString(" " + quote(a))
	}
	return b.String()
}

func (r *runtime) StartContainer(ctx context.Context, req *kubeapi.StartContainerRequest) (*kubeapi.StartContainerResponse, error) {
	id := req.GetContainerId()
	r.mu.Lock()
	rec := r.containers[id]
	r.mu.Unlock()
	if rec == nil || len(rec.Command) == 0 {
		return r.RemoteRuntime.StartContainer(ctx, req)
	}
	dir := filepath.Join(r.scratch, id)
	etc := filepath.Join(dir, "etc")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, status.Errorf(codes.Internal, "%v", err)
	}
	if out, err := exec.Command("cp", "-a", "/etc", etc).CombinedOutput(); err != nil {
		return nil, status.Errorf(codes.Internal, "copying /etc: %v: %s", err, out)
	}
	logFile, err := os.Create(filepath.Join(r.records, id+".log"))
	if err != nil {
		return nil, status.Errorf(codes.Internal, "%v", err)
	}
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c", r.script(rec, etc))
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, status.Errorf(codes.Internal, "starting %v: %v", rec.Command, err)
	}
	resp, err := r.RemoteRuntime.StartContainer(ctx, req)
	if err != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		return nil, err
	}
	r.mu.Lock()
	r.processes[id] = cmd
	rec.Started = true
	r.write(rec)
	r.mu.Unlock()
	go r.wait(id, rec, cmd, logFile, dir)
	return resp, nil
}

// wait reports the container exited when its process does.
func (r *runtime) wait(id string, rec *record, cmd *exec.Cmd, logFile *os.File, scratch string) {
	err := cmd.Wait()
	logFile.Close()
	code := 0
	if exit, ok := err.(*exec.ExitError); ok {
		code = exit.ExitCode()
	} else if err != nil {
		code = 128
	}
	_ = os.RemoveAll(scratch)
	_ = os.Remove(filepath.Join(cgroupRoot, "pod"+rec.PodUID, id))
	_ = os.Remove(filepath.Join(cgroupRoot, "pod"+rec.PodUID))
	fakes := r.RemoteRuntime.RuntimeService
	fakes.Lock()
	if c, ok := fakes.Containers[id]; ok && c.State == kubeapi.ContainerState_CONTAINER_RUNNING {
		c.State = kubeapi.ContainerState_CONTAINER_EXITED
		c.FinishedAt = time.Now().UnixNano()
		c.ExitCode = int32(code)
		c.Reason = "Completed"
		if code != 0 {
			c.Reason = "Error"
		}
	}
	fakes.Unlock()
	r.mu.Lock()
	delete(r.processes, id)
	rec.ExitCode = &code
	r.write(rec)
	r.mu.Unlock()
	log.Printf("container %s of %s/%s exited with %d", id, rec.Namespace, rec.Pod, code)
}

func (r *runtime) kill(id string) {
	r.mu.Lock()
	cmd := r.processes[id]
	r.mu.Unlock()
	if cmd != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
}

func (r *runtime) StopContainer(ctx context.Context, req *kubeapi.StopContainerRequest) (*kubeapi.StopContainerResponse, error) {
	r.kill(req.GetContainerId())
	return r.RemoteRuntime.StopContainer(ctx, req)
}

func (r *runtime) RemoveContainer(ctx context.Context, req *kubeapi.RemoveContainerRequest) (*kubeapi.RemoveContainerResponse, error) {
	r.kill(req.GetContainerId())
	return r.RemoteRuntime.RemoveContainer(ctx, req)
}

func main() {
	endpoint := flag.String("endpoint", "", "CRI endpoint to serve, unix:///path")
	records := flag.String("records", "", "directory for the containers' records and logs")
	cdiDir := flag.String("cdi-dir", "/var/run/cdi", "CDI spec directory")
	scratch := flag.String("scratch", "", "directory for the containers' private copies of /etc")
	flag.Parse()
	if *endpoint == "" || *records == "" || *scratch == "" {
		log.Fatal("--endpoint, --records and --scratch are required")
	}
	for _, d := range []string{*records, *scratch, *cdiDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			log.Fatal(err)
		}
	}
	schemaDir, err := os.MkdirTemp("", "cdi-schema-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(schemaDir)
	for _, name := range []string{"schema.json", "defs.json"} {
		data, _ := schemaFiles.ReadFile("cdi-schema/" + name)
		if err := os.WriteFile(filepath.Join(schemaDir, name), data, 0o644); err != nil {
			log.Fatal(err)
		}
	}
	schema, err := gojsonschema.NewSchema(gojsonschema.NewReferenceLoader("file://" + filepath.Join(schemaDir, "schema.json")))
	if err != nil {
		log.Fatalf("CDI schema: %v", err)
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(*cdiDir), cdi.WithAutoRefresh(false))
	if err != nil {
		log.Fatal(err)
	}
	base := fake.NewFakeRemoteRuntime()
	// Without a size the kubelet reports ImageInspectError; without these conditions the node
	// never becomes Ready.
	base.ImageService.SetFakeImageSize(1 << 20)
	base.RuntimeService.FakeStatus = &kubeapi.RuntimeStatus{Conditions: []*kubeapi.RuntimeCondition{
		{Type: kubeapi.RuntimeReady, Status: true},
		{Type: kubeapi.NetworkReady, Status: true},
	}}
	r := &runtime{
		RemoteRuntime: base,
		records:       *records,
		scratch:       *scratch,
		cdi:           cache,
		schema:        schema,
		containers:    map[string]*record{},
		processes:     map[string]*exec.Cmd{},
	}
	// The fake serves itself; serve the wrapper instead, on the same kind of listener.
	server := grpc.NewServer()
	kubeapi.RegisterRuntimeServiceServer(server, r)
	kubeapi.RegisterImageServiceServer(server, r)
	listener, err := util.CreateListener(*endpoint)
	if err != nil {
		log.Fatalf("listening on %s: %v", *endpoint, err)
	}
	go func() {
		if err := server.Serve(listener); err != nil {
			log.Fatalf("serving CRI: %v", err)
		}
	}()
	log.Printf("serving CRI on %s", *endpoint)
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	<-signals
	r.mu.Lock()
	for _, cmd := range r.processes {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	r.mu.Unlock()
	// The processes' waiters remove their cgroups; give them a moment.
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		r.mu.Lock()
		left := len(r.processes)
		r.mu.Unlock()
		if left == 0 {
			break
		}
	}
	_ = os.Remove(cgroupRoot)
	server.Stop()
}
