{{/* Names and labels shared by every template. */}}

{{- define "posttrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: "<release>-posttrain", or the release name when it already
contains the chart name (release "posttrain" gives "posttrain"). */}}
{{- define "posttrain.fullname" -}}
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

{{/* Cluster-scoped objects (ClusterRole/Binding, webhook configuration). One operator
serves the whole cluster, so the release's full name is enough. */}}
{{- define "posttrain.clusterName" -}}
{{- include "posttrain.fullname" . -}}
{{- end -}}

{{/* The ClusterRole the operator binds each namespace's trainer ServiceAccount to. */}}
{{- define "posttrain.trainerClusterRole" -}}
{{- include "posttrain.clusterName" . -}}-trainer
{{- end -}}

{{- define "posttrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "posttrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "posttrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "posttrain.labels" -}}
helm.sh/chart: {{ include "posttrain.chart" . }}
{{ include "posttrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: posttrain
{{- end -}}

{{- define "posttrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "posttrain.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "posttrain.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The leader-election Lease; the name is fixed in the operator (LEASE_NAME). */}}
{{- define "posttrain.leaseName" -}}posttrain-operator{{- end -}}

{{- define "posttrain.webhookServiceName" -}}
{{- printf "%s-webhook" (include "posttrain.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "posttrain.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "posttrain.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "posttrain.webhookCertName" -}}
{{- printf "%s-webhook" (include "posttrain.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* kopf serves each admission handler at "/<handler id>"; posttrain's validating
handler id is "validate-posttrainjob.posttrain.dev" (posttrain/controller/admission.py). */}}
{{- define "posttrain.webhookPath" -}}/validate-posttrainjob.posttrain.dev{{- end -}}
