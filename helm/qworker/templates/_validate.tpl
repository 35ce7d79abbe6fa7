{{/*
Rules that span several values, which values.schema.json cannot express.
Every template includes this, so a bad combination fails `helm install` and
`helm template` before anything reaches the cluster. Messages name the keys.
*/}}
{{- define "qworker.validate" -}}
{{- $v := .Values -}}
{{- $k := $v.kafka -}}
{{- $a := $v.autoscaling -}}
{{- $partitions := int $k.jobsPartitions -}}

{{- if not (trim (toString (default "" $k.bootstrapServers))) -}}
{{- fail "qworker: kafka.bootstrapServers is required (comma-separated host:port list of your Kafka brokers)" -}}
{{- end -}}

{{- if lt (int $v.replicaCount) 0 -}}
{{- fail (printf "qworker: replicaCount must be >= 0, got %d" (int $v.replicaCount)) -}}
{{- end -}}

{{- if $a.enabled -}}
  {{- $min := int $a.minReplicas -}}
  {{- $max := int $a.maxReplicas -}}
  {{- if lt $min 0 -}}
  {{- fail (printf "qworker: autoscaling.minReplicas must be >= 0, got %d" $min) -}}
  {{- end -}}
  {{- if gt $min $max -}}
  {{- fail (printf "qworker: autoscaling.minReplicas (%d) must not exceed autoscaling.maxReplicas (%d)" $min $max) -}}
  {{- end -}}
  {{- if gt $max $partitions -}}
  {{- fail (printf "qworker: autoscaling.maxReplicas (%d) must not exceed kafka.jobsPartitions (%d): a consumer group gives each partition to one pod, so extra pods would sit idle. Create the jobs topic with more partitions or lower maxReplicas" $max $partitions) -}}
  {{- end -}}
  {{- if $a.keda.enabled -}}
    {{- $fb := int (include "qworker.keda.fallbackReplicas" .) -}}
    {{- if and $a.keda.fallback.enabled (gt $fb $max) -}}
    {{- fail (printf "qworker: autoscaling.keda.fallback.replicas (%d) must not exceed autoscaling.maxReplicas (%d)" $fb $max) -}}
    {{- end -}}
    {{- if lt (int (include "qworker.keda.lagThreshold" .)) 1 -}}
    {{- fail "qworker: autoscaling.keda.lagThreshold must be >= 1" -}}
    {{- end -}}
  {{- else -}}
    {{- if lt $min 1 -}}
    {{- fail "qworker: autoscaling.minReplicas must be >= 1 with the plain HPA (autoscaling.keda.enabled=false); scale to zero needs KEDA" -}}
    {{- end -}}
    {{- if and (eq $a.hpa.metric "cpu") (not (dig "requests" "cpu" "" ($v.resources | default dict))) -}}
    {{- fail "qworker: the CPU-based HPA needs resources.requests.cpu (utilisation is measured against the request)" -}}
    {{- end -}}
  {{- end -}}
{{- else -}}
  {{- if gt (int $v.replicaCount) $partitions -}}
  {{- fail (printf "qworker: replicaCount (%d) must not exceed kafka.jobsPartitions (%d): extra consumers in the group would sit idle" (int $v.replicaCount) $partitions) -}}
  {{- end -}}
{{- end -}}

{{- $grace := int (include "qworker.gracePeriod" .) -}}
{{- $drain := int $v.worker.drainTimeoutSeconds -}}
{{- /* after the drain the stop waits up to 20 s on the broker (commit, leave the group, flush)
     and 5 s on the trace exporter: a shorter grace period kills it there */ -}}
{{- if lt $grace (add $drain 25) -}}
{{- fail (printf "qworker: terminationGracePeriodSeconds (%d) must be at least worker.drainTimeoutSeconds (%d) + 25 (the broker steps and the trace flush after the drain), or the kubelet kills the worker before it commits and its jobs run twice; leave it empty for drain + 30" $grace $drain) -}}
{{- end -}}

{{- if $k.sasl.enabled -}}
  {{- if not $k.sasl.existingSecret -}}
    {{- if or (not $k.sasl.username) (not $k.sasl.password) -}}
    {{- fail "qworker: kafka.sasl.enabled needs kafka.sasl.existingSecret, or both kafka.sasl.username and kafka.sasl.password" -}}
    {{- end -}}
  {{- end -}}
{{- end -}}

{{- if $k.tls.enabled -}}
  {{- if not $k.tls.existingSecret -}}
    {{- if not $k.tls.ca -}}
    {{- fail "qworker: kafka.tls.enabled needs kafka.tls.existingSecret, or the broker CA as PEM in kafka.tls.ca" -}}
    {{- end -}}
    {{- if and $k.tls.clientAuth (or (not $k.tls.cert) (not $k.tls.key)) -}}
    {{- fail "qworker: kafka.tls.clientAuth needs kafka.tls.cert and kafka.tls.key (or kafka.tls.existingSecret)" -}}
    {{- end -}}
  {{- end -}}
{{- end -}}

{{- if include "qworker.model.volumeSource" . -}}
  {{- if not $v.model.mountPath -}}
  {{- fail "qworker: the model has a volume (model.existingClaim or model.volume), so model.mountPath is required" -}}
  {{- end -}}
  {{- $mp := trimSuffix "/" $v.model.mountPath -}}
  {{- if not (or (eq $v.model.path $mp) (hasPrefix (printf "%s/" $mp) $v.model.path)) -}}
  {{- fail (printf "qworker: model.path (%s) must lie inside model.mountPath (%s), where the model volume is mounted" $v.model.path $mp) -}}
  {{- end -}}
{{- end -}}

{{- if $v.lora.enabled -}}
  {{- $lp := trimSuffix "/" $v.lora.mountPath -}}
  {{- range $name, $path := $v.lora.modules -}}
    {{- if not (hasPrefix (printf "%s/" $lp) $path) -}}
    {{- fail (printf "qworker: lora.modules.%s (%s) must lie inside lora.mountPath (%s), where the adapters are mounted (QWORKER_LORA_ROOT)" $name $path $lp) -}}
    {{- end -}}
  {{- end -}}
  {{- if and (not (kindIs "invalid" $v.lora.maxCpuLoras)) (lt (int $v.lora.maxCpuLoras) (int $v.lora.maxLoras)) -}}
  {{- fail (printf "qworker: lora.maxCpuLoras (%d) must be at least lora.maxLoras (%d)" (int $v.lora.maxCpuLoras) (int $v.lora.maxLoras)) -}}
  {{- end -}}
  {{- if and (include "qworker.model.volumeSource" .) (include "qworker.lora.volumeSource" .) (eq (trimSuffix "/" $v.model.mountPath) $lp) -}}
  {{- fail "qworker: lora.mountPath must differ from model.mountPath when both have a volume" -}}
  {{- end -}}
{{- end -}}

{{- if $v.podDisruptionBudget.enabled -}}
  {{- $pdb := $v.podDisruptionBudget -}}
  {{- if and (kindIs "invalid" $pdb.maxUnavailable) (kindIs "invalid" $pdb.minAvailable) -}}
  {{- fail "qworker: podDisruptionBudget.enabled needs maxUnavailable or minAvailable" -}}
  {{- end -}}
  {{- if and (not (kindIs "invalid" $pdb.maxUnavailable)) (eq (toString $pdb.maxUnavailable) "0" "0%") -}}
  {{- fail "qworker: podDisruptionBudget.maxUnavailable 0 would block every node drain; use 1 or disable the PDB" -}}
  {{- end -}}
{{- end -}}

{{- $tp := $v.tensorParallel -}}
{{- if and (gt (int $tp.size) 1) (gt (int $tp.leaderWorkerSet.collectiveTimeoutSeconds) 86400) -}}
{{- fail (printf "qworker: tensorParallel.leaderWorkerSet.collectiveTimeoutSeconds (%d) must be at most 86400 (QWORKER_TP_TIMEOUT_S)" (int $tp.leaderWorkerSet.collectiveTimeoutSeconds)) -}}
{{- end -}}
{{- if and $v.lora.enabled (gt (int $tp.size) 1) -}}
{{- fail "qworker: lora.enabled is not supported with tensorParallel.size > 1 (the engine refuses it at start)" -}}
{{- end -}}
{{- if $tp.leaderWorkerSet.enabled -}}
  {{- if lt (int $tp.size) 2 -}}
  {{- fail "qworker: tensorParallel.leaderWorkerSet.enabled needs tensorParallel.size >= 2 (one pod per rank)" -}}
  {{- end -}}
  {{- if and $v.gpu.enabled (ne (int $v.gpu.count) 1) -}}
  {{- fail (printf "qworker: with tensorParallel.leaderWorkerSet each pod is one rank on one GPU: set gpu.count to 1 (got %d)" (int $v.gpu.count)) -}}
  {{- end -}}
  {{- if eq (int $tp.leaderWorkerSet.port) (int $v.worker.httpPort) -}}
  {{- fail (printf "qworker: tensorParallel.leaderWorkerSet.port (%d) must differ from worker.httpPort: the probe server binds it first and the rendezvous could not" (int $v.worker.httpPort)) -}}
  {{- end -}}
{{- else if and $v.gpu.enabled (gt (int $tp.size) (int $v.gpu.count)) -}}
  {{- fail (printf "qworker: tensorParallel.size (%d) needs one GPU per rank in the pod: set gpu.count to at least %d, or use tensorParallel.leaderWorkerSet" (int $tp.size) (int $tp.size)) -}}
{{- end -}}

{{- $startupBudget := mul (int $v.probes.startup.periodSeconds) (int $v.probes.startup.failureThreshold) -}}
{{- if lt $startupBudget 60 -}}
{{- fail (printf "qworker: the startup probe allows only %d s (periodSeconds x failureThreshold) for model load; give it at least 60 s" $startupBudget) -}}
{{- end -}}
{{- end -}}
