// The kubelet tests' container runtime: the kubelet's fake CRI server with CDI and local processes.
module gpuslice.dev/controlplane/testruntime

go 1.26.0

require (
	github.com/opencontainers/runtime-spec v1.3.0
	github.com/xeipuuv/gojsonschema v1.2.0
	google.golang.org/grpc v1.79.3
	k8s.io/cri-api v0.36.3
	k8s.io/cri-client v0.36.3
	tags.cncf.io/container-device-interface v1.1.2
)

require (
	github.com/Microsoft/go-winio v0.6.2 // indirect
	github.com/fsnotify/fsnotify v1.9.0 // indirect
	github.com/stretchr/testify v1.12.1 // indirect
	github.com/xeipuuv/gojsonpointer v0.0.0-20180127040702-4e3ac2762d5f // indirect
	github.com/xeipuuv/gojsonreference v0.0.0-20180127040603-bd5ef7bd5415 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/net v0.49.0 // indirect
	golang.org/x/sys v0.40.0 // indirect
	golang.org/x/text v0.33.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260128011058-8636f8732409 // indirect
	google.golang.org/protobuf v1.36.12-0.20260120151049-f2248ac996af // indirect
	k8s.io/utils v0.0.0-20260210185600-b8788abfbbc2 // indirect
	tags.cncf.io/container-device-interface/specs-go v1.1.1 // indirect
)
