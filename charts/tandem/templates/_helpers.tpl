{{/*
Expand the name of the chart.
*/}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
Every object of this chart is named exactly this (kinds differ), so no suffix can push a name past 63;
the dashboard ConfigMaps, the one exception, cut it shorter to fit their suffix.
*/}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector labels
*/}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Operator labels. The operator labels the pods of an InferenceService with the same name and instance
keys (component prefill, decode or router), so the operator's own selector also needs its component:
without it a release named like an InferenceService in the same namespace would select that service's pods.
*/}}
{{- define "tandem.operator.labels" -}}
{{ include "tandem.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "tandem.operator.selectorLabels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Create the name of the service account to use
*/}}
{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Image references; an empty tag means the chart's appVersion.
*/}}
{{- define "tandem.operator.image" -}}
{{- printf "%s:%s" .Values.operator.image.repository (.Values.operator.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "tandem.routerImage" -}}
{{- printf "%s:%s" .Values.routerImage.repository (.Values.routerImage.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
RBAC rules for what the operator reads and writes inside a watched namespace: InferenceServices and their
status (kopf keeps finalizers and handler progress on the object), the kinds it renders
(tandem.operator.kube.PLURALS), the Events it posts, and the pools' pods the autoscaler reads (to find and
scrape the ready servers).
*/}}
{{- define "tandem.rbac.namespacedRules" -}}
- apiGroups: ["tandem.dev"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["tandem.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch", "update"]
{{- /* Owned objects carry blockOwnerDeletion: clusters that enforce owner-reference permissions
  require update on the owner's finalizers to set it. */}}
- apiGroups: ["tandem.dev"]
  resources: ["inferenceservices/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
{{- /* Each InferenceService's bootstrap-token Secret: looked up, created once, never changed, deleted with it. */}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors", "podmonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/*
RBAC rules kopf needs cluster-wide whatever it watches: CRDs (resource discovery) and namespaces
(to find the watched namespaces).
*/}}
{{- define "tandem.rbac.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end }}
