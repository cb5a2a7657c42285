{{/* Labels on every object's metadata: the Kustomize base's part-of, and Helm's own. */}}
{{- define "kvgate.labels" -}}
app.kubernetes.io/part-of: kvgate
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvgate.image" -}}
{{- $image := index .root.Values.images .name -}}
{{ printf "%s:%s" $image.repository $image.tag }}
{{- end -}}

{{/* etcd's client endpoints: the chart's Service, or yours. */}}
{{- define "kvgate.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
["etcd-client:2379"]
{{- else -}}
{{- if not .Values.etcd.endpoints -}}
{{- fail "etcd.enabled is false: name your etcd in etcd.endpoints" -}}
{{- end -}}
[{{ range $i, $e := .Values.etcd.endpoints }}{{ if $i }}, {{ end }}{{ $e | quote }}{{ end }}]
{{- end -}}
{{- end -}}

{{/* The mounted certificates (Secret kvgate-certs), as the configs name them. */}}
{{- define "kvgate.tlsDir" -}}/etc/kvgate-tls{{- end -}}

{{- define "kvgate.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}
