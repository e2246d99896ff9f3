-- Argo CD health of a GpuSlicePolicy, from the Ready condition the gpuslice operator writes.
-- Degraded: no slice of its pool can hold it, or its pool or CheckpointPolicy does not exist.
-- Progressing: its pool has no GPUs yet. Healthy: a slice fits it.
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the gpuslice operator to report the policy's status"
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
  hs.message = "Waiting for the gpuslice operator to report the policy's status"
  return hs
end
hs.message = ready.message
if ready.status == "True" then
  hs.status = "Healthy"
  if obj.status.waiting ~= nil and obj.status.waiting > 0 then
    hs.message = ready.message .. "; " .. obj.status.waiting .. " pod(s) waiting for a slice"
  end
elseif ready.reason == "NoGpus" then
  hs.status = "Progressing"
else
  hs.status = "Degraded"
end
return hs
