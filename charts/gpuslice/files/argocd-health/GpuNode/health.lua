-- Argo CD health of a GpuNode (written by the gpuslice operator, reported by the node's agent).
-- Degraded: the agent failed to apply the layout, the node's NVIDIA driver is too old for
-- software slices (DriverSupported False: they are not offered until it is upgraded), or XID
-- errors took slices or GPUs out of service (Quarantined True), or a pool's I/O limit per slice
-- cannot be applied (IoLimited False: the node has no cgroup I/O controller). Progressing: the agent has not applied this
-- generation yet, or busy slices block the change until they drain. Healthy: applied.
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the node's gpuslice agent to report"
  return hs
end
local conditions = {}
for _, c in ipairs(obj.status.conditions) do
  conditions[c.type] = c
end
local ready = conditions["Ready"]
local blocked = conditions["Blocked"]
if ready ~= nil and ready.status == "False" and ready.reason == "Failed" then
  hs.status = "Degraded"
  hs.message = ready.message
  return hs
end
-- Each condition whose status here means the node is degraded, in the order they are shown.
local degraded = {
  {type = "DriverSupported", status = "False"},
  {type = "Quarantined", status = "True"},
  {type = "IoLimited", status = "False"},
}
for _, d in ipairs(degraded) do
  local c = conditions[d.type]
  if c ~= nil and c.status == d.status then
    hs.status = "Degraded"
    hs.message = c.message
    return hs
  end
end
if blocked ~= nil and blocked.status == "True" then
  hs.status = "Progressing"
  hs.message = "Waiting for busy slices to drain: " .. blocked.message
  return hs
end
local generation = obj.metadata.generation
local applied = obj.status.appliedGeneration
if ready ~= nil and ready.status == "True" and (generation == nil or (applied ~= nil and applied >= generation)) then
  hs.status = "Healthy"
  hs.message = "The node's GPUs have the layout of generation " .. (applied or "?")
  return hs
end
hs.status = "Progressing"
if generation ~= nil then
  hs.message = "Waiting for the node's agent to apply generation " .. generation
else
  hs.message = "Waiting for the node's agent to apply the layout"
end
return hs
