{{- /*
gpuslice's alerting rules (the `groups` of a Prometheus rule file). The agents' and operator's
jobs are those the metrics Services give under prometheus-operator: <release>-agent-metrics and
<release>-operator-metrics.
*/ -}}
{{- define "gpuslice.alertGroups" -}}
groups:
  - name: gpuslice
    rules:
      - alert: GpuSlicePoolDegraded
        expr: max by (pool) (gpuslice_pool_condition{condition="Degraded"}) == 1
        for: {{ .Values.metrics.prometheusRule.degradedFor }}
        labels: {severity: warning}
        annotations:
          summary: {{`GpuPool {{ $labels.pool }} is Degraded`}}
          description: {{`GpuPool {{ $labels.pool }} cannot be laid out as declared; kubectl describe gpupool {{ $labels.pool }} says what to change.`}}
      - alert: GpuSliceTransitionBlocked
        expr: max by (instance) (gpuslice_agent_transition_blocked) == 1
        for: {{ .Values.metrics.prometheusRule.blockedFor }}
        labels: {severity: warning}
        annotations:
          summary: {{`A layout change on {{ $labels.instance }} waits for busy slices`}}
          description: {{`The agent at {{ $labels.instance }} has waited for busy slices to drain for a while; the GpuNode's Blocked condition names the pods.`}}
      - alert: GpuSliceQueueStuck
        expr: sum by (pool) (gpuslice_queue_waiting_pods) > 0 unless sum by (pool) (increase(gpuslice_queue_wait_seconds_count[30m])) > 0
        for: 30m
        labels: {severity: info}
        annotations:
          summary: {{`Pods wait in the queue of pool {{ $labels.pool }} and none was admitted for 30 minutes`}}
          description: {{`No free slice of pool {{ $labels.pool }} fits the waiting pods; their gpuslice.io/Queued condition says why.`}}
      - alert: GpuSliceNearMemoryCap
        expr: max by (instance, slice, namespace, pod) (gpuslice_agent_slice_memory_used_bytes / gpuslice_agent_slice_memory_bytes) > 0.95
        for: 10m
        labels: {severity: info}
        annotations:
          summary: {{`Slice {{ $labels.slice }} ({{ $labels.namespace }}/{{ $labels.pod }}) holds over 95% of its memory`}}
          description: {{`Allocations past the slice's cap fail with out-of-memory inside the workload; a policy with more memory fits it.`}}
      - alert: GpuSliceMemoryCapRefusals
        expr: |-
          (sum by (instance, slice) (increase(gpuslice_agent_slice_memory_refusals_total[10m])) > 0)
          * on (instance, slice) group_left (policy, class, namespace, pod)
          max by (instance, slice, policy, class, namespace, pod) (gpuslice_agent_slice_holder)
        for: {{ .Values.metrics.prometheusRule.capRefusalsFor }}
        labels: {severity: warning}
        annotations:
          summary: {{`Slice {{ $labels.slice }} on {{ $labels.instance }} refused allocations at its memory cap`}}
          description: {{`The workload on slice {{ $labels.slice }} ({{ $labels.namespace }}/{{ $labels.pod }}, policy {{ $labels.policy }}) asked for more than its cap and got out-of-memory errors; gpuslice_agent_slice_memory_peak_bytes shows how much it held. A policy with more memory fits it.`}}
      - alert: GpuSliceComputeGuaranteeMissed
        expr: |-
          (
            (
              100 * sum by (instance, slice) (rate(gpuslice_agent_slice_compute_used_seconds_total[5m]))
                / sum by (instance, slice) (rate(gpuslice_agent_slice_compute_busy_seconds_total[5m]))
            ) < on (instance, slice) (0.9 * max by (instance, slice) (gpuslice_agent_slice_compute_guarantee_percent))
            and on (instance, slice) sum by (instance, slice) (rate(gpuslice_agent_slice_compute_busy_seconds_total[5m])) > 0.5
          )
          * on (instance, slice) group_left (policy, class, namespace, pod)
          max by (instance, slice, policy, class, namespace, pod) (gpuslice_agent_slice_holder)
        for: {{ .Values.metrics.prometheusRule.guaranteeMissedFor }}
        labels: {severity: warning}
        annotations:
          summary: {{`Slice {{ $labels.slice }} on {{ $labels.instance }} gets less GPU time than its guarantee`}}
          description: {{`While it had work, slice {{ $labels.slice }} ({{ $labels.namespace }}/{{ $labels.pod }}) got {{ $value | printf "%.0f" }}% of the GPU, under 90% of its policy's guarantee; the GPU's slices promise more than it can give (guarantees adding up past 100), or a neighbour holds it too long.`}}
      - alert: GpuSliceAgentDown
        expr: up{job="{{ .Release.Name }}-agent-metrics"} == 0
        for: {{ .Values.metrics.prometheusRule.agentDownFor }}
        labels: {severity: critical}
        annotations:
          summary: {{`The gpuslice agent at {{ $labels.instance }} is down`}}
          description: {{`Slices on that node are neither published nor re-cut, and claims are not prepared, until it is back.`}}
      - alert: GpuSliceOperatorDown
        expr: absent(up{job="{{ .Release.Name }}-operator-metrics"} == 1)
        for: {{ .Values.metrics.prometheusRule.agentDownFor }}
        labels: {severity: critical}
        annotations:
          summary: gpuslice's operator is down
          description: Pools are not reconciled and queued pods are not admitted until it is back.
{{- end -}}
