{{/* Names ------------------------------------------------------------- */}}

{{- define "qworker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qworker.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "qworker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qworker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "qworker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: worker
{{- end -}}

{{- define "qworker.labels" -}}
helm.sh/chart: {{ include "qworker.chart" . }}
{{ include "qworker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "qworker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "qworker.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "qworker.image" -}}
{{- $variant := ternary "cuda" "cpu" .Values.gpu.enabled -}}
{{- $tag := .Values.image.tag | toString | default (printf "%s-%s" .Chart.AppVersion $variant) -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Kafka security --------------------------------------------------- */}}

{{- define "qworker.kafka.securityProtocol" -}}
{{- $k := .Values.kafka -}}
{{- if and $k.sasl.enabled $k.tls.enabled -}}SASL_SSL
{{- else if $k.sasl.enabled -}}SASL_PLAINTEXT
{{- else if $k.tls.enabled -}}SSL
{{- else -}}PLAINTEXT
{{- end -}}
{{- end -}}

{{/* The chart creates one Secret when SASL or TLS material is given inline. */}}
{{- define "qworker.kafka.managedSecretName" -}}
{{- printf "%s-kafka" (include "qworker.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qworker.kafka.saslSecretName" -}}
{{- default (include "qworker.kafka.managedSecretName" .) .Values.kafka.sasl.existingSecret -}}
{{- end -}}

{{- define "qworker.kafka.tlsSecretName" -}}
{{- default (include "qworker.kafka.managedSecretName" .) .Values.kafka.tls.existingSecret -}}
{{- end -}}

{{- define "qworker.kafka.needsManagedSecret" -}}
{{- $k := .Values.kafka -}}
{{- if or (and $k.sasl.enabled (not $k.sasl.existingSecret)) (and $k.tls.enabled (not $k.tls.existingSecret)) -}}true{{- end -}}
{{- end -}}

{{- define "qworker.kafka.tlsDir" -}}/etc/qworker/kafka-tls{{- end -}}

{{/* KEDA names the SASL mechanism in its own spelling. */}}
{{- define "qworker.keda.sasl" -}}
{{- $m := .Values.kafka.sasl.mechanism -}}
{{- if eq $m "PLAIN" -}}plaintext
{{- else if eq $m "SCRAM-SHA-256" -}}scram_sha256
{{- else -}}scram_sha512
{{- end -}}
{{- end -}}

{{/* Derived numbers ---------------------------------------------------- */}}

{{- define "qworker.gracePeriod" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- add (int .Values.worker.drainTimeoutSeconds) 30 -}}
{{- else -}}
{{- int .Values.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/* One pod's job capacity: running sequences plus its admission queue.
     The worker commits an offset only when every job before it is done, so
     this is the lag a busy pod carries by itself. */}}
{{- define "qworker.podJobCapacity" -}}
{{- add (int .Values.worker.maxNumSeqs) (int .Values.worker.maxWaitingJobs) -}}
{{- end -}}

{{- define "qworker.keda.lagThreshold" -}}
{{- $lt := int (default 0 .Values.autoscaling.keda.lagThreshold) -}}
{{- if gt $lt 0 -}}{{ $lt }}{{- else -}}{{ include "qworker.podJobCapacity" . }}{{- end -}}
{{- end -}}

{{- define "qworker.keda.fallbackReplicas" -}}
{{- $r := int (default 0 .Values.autoscaling.keda.fallback.replicas) -}}
{{- if gt $r 0 -}}{{ $r }}{{- else -}}{{ max 1 (int .Values.autoscaling.minReplicas) }}{{- end -}}
{{- end -}}

{{/* The model's volume source as YAML, or nothing when the model is baked in. */}}
{{- define "qworker.model.volumeSource" -}}
{{- if .Values.model.volume -}}
{{- toYaml .Values.model.volume -}}
{{- else if .Values.model.existingClaim -}}
persistentVolumeClaim:
  claimName: {{ .Values.model.existingClaim }}
  readOnly: true
{{- end -}}
{{- end -}}

{{- define "qworker.lora.volumeSource" -}}
{{- if .Values.lora.volume -}}
{{- toYaml .Values.lora.volume -}}
{{- else if .Values.lora.existingClaim -}}
persistentVolumeClaim:
  claimName: {{ .Values.lora.existingClaim }}
  readOnly: true
{{- end -}}
{{- end -}}

{{/* Where the LoRA modules ConfigMap is mounted (a folder: subPath mounts never update). */}}
{{- define "qworker.lora.modulesDir" -}}/etc/qworker/lora{{- end -}}

{{- define "qworker.kafka.authNeeded" -}}
{{- if or .Values.kafka.sasl.enabled .Values.kafka.tls.enabled -}}true{{- end -}}
{{- end -}}
