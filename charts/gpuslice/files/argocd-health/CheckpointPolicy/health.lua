-- Argo CD health of a CheckpointPolicy, from the Ready condition the gpuslice operator writes.
-- Degraded: pods wait for its storage claim, which does not exist in their namespace.
-- Healthy: it drains some policy's or pool's workloads, or none names it yet.
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the gpuslice operator to report the CheckpointPolicy's status"
  return hs
end
local generation = obj.metadata.generation
if generation ~= nil and obj.status.observedGeneration ~= nil and obj.status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the gpuslice operator to observe generation " .. generation
  return hs
end
local ready = nil
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Ready" then
    ready = c
  end
end
if ready == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the gpuslice operator to report the CheckpointPolicy's status"
  return hs
end
hs.message = ready.message
if ready.status == "True" then
  hs.status = "Healthy"
else
  hs.status = "Degraded"
end
return hs
