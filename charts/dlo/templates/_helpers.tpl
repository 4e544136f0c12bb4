{{- define "dlo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* The prefix of every object's name: fullnameOverride, else <release> when it already contains the
name, else <release>-<name> (the convention of `helm create`). */}}
{{- define "dlo.fullname" -}}
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

{{- define "dlo.labels" -}}
app.kubernetes.io/name: {{ include "dlo.name" . }}
app.kubernetes.io/part-of: dlo
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dlo.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- /* The engine image DLODeployments get when spec.engine.image is not set (the operator reads it
from DLO_DEFAULT_ENGINE_IMAGE). */}}
{{- define "dlo.engineImage" -}}
{{ .Values.engine.image.repository }}:{{ .Values.engine.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- /* The service account of a component: dict "root" $ "component" "operator"|"agent". */}}
{{- define "dlo.serviceAccountName" -}}
{{- $sa := (index .root.Values .component).serviceAccount -}}
{{- if $sa.create -}}
{{- default (printf "%s-%s" (include "dlo.fullname" .root) .component) $sa.name -}}
{{- else -}}
{{- default "default" $sa.name -}}
{{- end -}}
{{- end -}}

{{- /* The operator's cluster-wide rules: what is not in a namespace. */}}
{{- define "dlo.operatorClusterRules" -}}
# Nodes: profiles (mode auto, residency, fetched models) through a watch, and the labels
# model.dlo.dev/<key> it sets when a node holds a fetched model completely.
- apiGroups: [""]
  resources: [nodes]
  verbs: [list, watch, patch]
# kopf observes the resources it serves, and namespaces when watchNamespaces holds a pattern.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end -}}

{{- /* The operator's rules in the namespaces it watches (a ClusterRole when it watches all). */}}
{{- define "dlo.operatorNamespacedRules" -}}
# The resource it reconciles: kopf lists and watches it; the operator patches its status, and
# removes the finalizer an earlier version's kopf daemon added. It never gets one by name.
- apiGroups: [dlo.dev]
  resources: [dlodeployments]
  verbs: [list, watch, patch]
- apiGroups: [dlo.dev]
  resources: [dlodeployments/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion, which needs this where the
# OwnerReferencesPermissionEnforcement admission plugin is on (an authorisation check, no call).
- apiGroups: [dlo.dev]
  resources: [dlodeployments/finalizers]
  verbs: [update]
# The children it owns, server-side applied (patch; create when they do not exist yet). Deletion is
# the garbage collector's (owner references); the StatefulSets are watched (another writer's change
# is applied over at once; the model its pods run), and read where the watch has not seen one yet.
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch]
# networkPolicy.enabled: the engine pods' NetworkPolicy, server-side applied; deleted once turned off.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors, servicemonitors]
  verbs: [create, patch]
# spec.autoscaling: the KEDA ScaledObject or the HPA; the other one is deleted when it switches.
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [create, patch, delete]
# Engine and fetch pods through a watch; Recreate rollouts delete pods on an old template; a fetch
# Job's progress is the last line of its pod's log.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, delete]
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
# spec.model.uri: a fetch Job per node (watched; deleted once its node is labelled, or to retry).
- apiGroups: [batch]
  resources: [jobs]
  verbs: [list, watch, create, delete]
# An Event for each decision (core/v1, as kopf posts them); a pod's FailedMount events for status.
- apiGroups: [""]
  resources: [events]
  verbs: [create, list]
{{- end -}}

{{- /* Labels of a ServiceMonitor, PodMonitor or PrometheusRule: the chart's, `release` (the label
kube-prometheus-stack selects them by), then the object's additionalLabels:
dict "root" $ "extra" .Values.X.additionalLabels */}}
{{- define "dlo.monitorLabels" -}}
{{ include "dlo.labels" .root }}
{{- with .root.Values.monitoring.release }}
release: {{ . | quote }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- /* "true" where a monitoring object is made, else "": its `enabled` is true (always), false (never)
or "auto" (where the Prometheus Operator's CRD is installed: `has`, from .Capabilities; `helm
template` without a cluster needs --api-versions monitoring.coreos.com/v1/<Kind>).
dict "enabled" .Values.<x>.enabled "has" (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/<Kind>") */}}
{{- define "dlo.monitoringOn" -}}
{{- $enabled := toString .enabled -}}
{{- if or (eq $enabled "true") (and (eq $enabled "auto") .has) -}}true{{- end -}}
{{- end -}}

{{- /* The three monitoring switches resolved, as a dict of "true" or "": serviceMonitor, podMonitor,
prometheusRule. */}}
{{- define "dlo.monitoring" -}}
{{- $v1 := .Capabilities.APIVersions -}}
serviceMonitor: {{ include "dlo.monitoringOn" (dict "enabled" .Values.serviceMonitor.enabled "has" ($v1.Has "monitoring.coreos.com/v1/ServiceMonitor")) | quote }}
podMonitor: {{ include "dlo.monitoringOn" (dict "enabled" .Values.podMonitor.enabled "has" ($v1.Has "monitoring.coreos.com/v1/PodMonitor")) | quote }}
prometheusRule: {{ include "dlo.monitoringOn" (dict "enabled" .Values.prometheusRule.enabled "has" ($v1.Has "monitoring.coreos.com/v1/PrometheusRule")) | quote }}
{{- end -}}

{{- /* "true" where the node-patch ValidatingAdmissionPolicy is made (templates/nodepatchpolicy.yaml):
nodePatchPolicy.enabled true, or auto on Kubernetes >= 1.30 (admissionregistration.k8s.io/v1 serves
it), and the operator or the agent installed. */}}
{{- define "dlo.nodePatchPolicyOn" -}}
{{- $has := semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version -}}
{{- if and (include "dlo.monitoringOn" (dict "enabled" .Values.nodePatchPolicy.enabled "has" $has)) (or .Values.operator.enabled .Values.agent.enabled) -}}true{{- end -}}
{{- end -}}
