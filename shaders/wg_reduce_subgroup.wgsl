// Reductions over the threads of a workgroup (at most 256) with subgroup operations (the
// device offers them): each subgroup reduces in registers, its first lane leaves
// one partial in workgroup memory, and every thread adds the few partials. Same
// functions as wg_reduce.wgsl; every thread gets the result. The entry point sets
// the private values below from its subgroup built-ins.

var<workgroup> red: array<f32, 256>;
var<private> sg_lane_: u32;
var<private> sg_id_: u32;
var<private> sg_count_: u32;
var<private> sg_size_: u32;

fn wg_sum(v: f32, t: u32) -> f32 {
    let s = subgroupAdd(v);
    if (sg_lane_ == 0u) { red[sg_id_] = s; }
    workgroupBarrier();
    var r = 0.0;
    for (var i = 0u; i < sg_count_; i = i + 1u) { r = r + red[i]; }
    workgroupBarrier();
    return r;
}

fn wg_max(v: f32, t: u32) -> f32 {
    let s = subgroupMax(v);
    if (sg_lane_ == 0u) { red[sg_id_] = s; }
    workgroupBarrier();
    var r = red[0];
    for (var i = 1u; i < sg_count_; i = i + 1u) { r = max(r, red[i]); }
    workgroupBarrier();
    return r;
}
